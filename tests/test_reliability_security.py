"""Issue 7, A5 (authentication and credentials): against a head node with token
authentication on (the `head_node` fixture of tests/conftest.py: its own process group and temp dir), a job
submitted without the token is refused, and the job REST API answers 401 without it.
Nothing is run: the refused submission must not create a job. And the job never takes
an S3 secret on its command line (which `ray job list` shows)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from conftest import RAY, ROOT, ray_env


def _submit(address: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([RAY, "job", "submit", "--address", address, "--no-wait", "--", "echo", "pwned"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_unauthenticated_submit_is_refused(head_node):
    # 1. no RAY_AUTH_MODE=token: the CLI sends no token
    env = ray_env()
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_AUTH_TOKEN", None)
    res = _submit(head_node, env)
    assert res.returncode != 0, res.stdout + res.stderr
    # 2. token mode but no token to send (empty HOME, so no ~/.ray/auth_token)
    home = tempfile.mkdtemp(prefix="br-home-")
    env = {**ray_env(), "HOME": home}
    env.pop("RAY_AUTH_TOKEN", None)
    res2 = _submit(head_node, env)
    assert res2.returncode != 0, res2.stdout + res2.stderr
    # 3. a wrong token
    env = {**ray_env(), "HOME": home, "RAY_AUTH_TOKEN": "not-the-token"}
    res3 = _submit(head_node, env)
    assert res3.returncode != 0, res3.stdout + res3.stderr
    # 4. the REST API itself, no token
    try:
        urllib.request.urlopen(head_node + "/api/jobs/", timeout=10)
        status = 200
    except urllib.error.HTTPError as e:
        status = e.code
    assert status in (401, 403)
    # and nothing ran: the authenticated client sees no job
    probe = ("import sys, json; from ray.job_submission import JobSubmissionClient as C; "
             "print(json.dumps([j.entrypoint for j in C(sys.argv[1]).list_jobs()]))")
    listed = subprocess.run([sys.executable, "-c", probe, head_node], env=ray_env(), capture_output=True, text=True,
                            timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "pwned" not in "".join(json.loads(listed.stdout.strip().splitlines()[-1]))
    for r in (res, res2, res3):  # refused for authentication, not for some other reason
        assert "token" in (r.stdout + r.stderr).lower(), r.stdout + r.stderr
    os.rmdir(home)


def test_secret_is_refused_on_the_job_command_line():
    """A job's entrypoint is shown by `ray job list` and the dashboard (and so is its
    --runtime-env-json): the job takes S3 credentials from the cluster's environment only.
    `--secret-access-key` is refused with a pointer to AWS_SECRET_ACCESS_KEY, without
    echoing the value, before anything runs; --help does not offer it."""
    secret = "zQ9-COMMAND-LINE-SECRET-41c2"
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--secret-access-key", secret,
                          "--output", os.path.join(tempfile.gettempdir(), "never-written")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "AWS_SECRET_ACCESS_KEY" in res.stderr and "--secret-access-key" in res.stderr, res.stderr
    assert secret not in res.stdout + res.stderr
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "never-written"))
    helptext = subprocess.run([sys.executable, "jobs/offline_eval.py", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120).stdout
    assert "--secret-access-key" not in helptext and "AWS_SECRET_ACCESS_KEY" in helptext, helptext
