"""A constraint's regex checked as a regular language before outlines-core builds anything
from it (torch-free). `refusal` names what a DFA cannot express (back-references,
look-around, word boundaries, ...) with why, so a row asking for them gets a reason
instead of outlines-core's "Failed to build DFA". `count_states` determinizes the regex
(Python's regex parser, a Thompson NFA over the regex's own character classes, the subset
construction) and stops as soon as the DFA passes the cap: a regex whose DFA blows up
(`[ab]*a[ab]{14}`: 2^15 states from 16 characters) costs the cap's work, never its own
size, and outlines-core's token-level index (states x vocabulary) is only ever built for
a constraint known to fit."""
from __future__ import annotations

import bisect
from re import _constants as C, _parser as sre  # the stdlib's own regex parser (re.compile uses it)
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

MAX_CODE = 0x10FFFF
# per DFA state of the cap, the NFA states (pieces of the expanded regex) and the NFA states
# tracked over all DFA states the construction may hold: what keeps a regex of very many
# pieces (`(a?){60000}`) bounded too, whatever its DFA's size
NFA_PER_STATE = 64
WORK_PER_STATE = 128
# groups a user's regex may nest: Python's parser recurses per level, so past a few hundred
# it raises RecursionError at the default limit but not after torch's inductor has raised
# the limit; a fixed bound keeps the answer the same in every process
MAX_GROUP_DEPTH = 100

Intervals = Tuple[Tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges

WHY = {
    C.GROUPREF: "a back-reference (\\1, (?P=name)) matches whatever its group matched: no regular language (DFA) "
                "expresses that",
    C.GROUPREF_EXISTS: "a conditional group (?(1)...) depends on whether a group matched: no regular language (DFA) "
                       "expresses that",
    C.ATOMIC_GROUP: "atomic groups (?>...) change how a backtracking matcher searches, which a DFA does not do: "
                    "write the group without ?>",
    C.POSSESSIVE_REPEAT: "possessive quantifiers (*+, ++, ?+) change how a backtracking matcher searches, which a "
                         "DFA does not do: drop the trailing +",
}
AT_WHY = {
    C.AT_BOUNDARY: "word boundaries (\\b, \\B) are look-around, which the DFA the constraint is compiled to cannot do",
    C.AT_NON_BOUNDARY: "word boundaries (\\b, \\B) are look-around, which the DFA the constraint is compiled to "
                       "cannot do",
    C.AT_BEGINNING: "anchors (^, \\A, \\Z) are not supported: the whole answer is matched from its start to its end "
                    "already; leave them out",
    C.AT_BEGINNING_STRING: "anchors (^, \\A, \\Z) are not supported: the whole answer is matched from its start to "
                           "its end already; leave them out",
    C.AT_END_STRING: "anchors (^, \\A, \\Z) are not supported: the whole answer is matched from its start to its end "
                     "already; leave them out",
}


class OverCap(ValueError):
    """The regex's DFA (or the work of building it) passed the cap."""


def parse(regex: str):
    """Python's parse of `regex`; a ValueError when it does not parse (a re.error) or
    nests too deeply for the parser (a RecursionError)."""
    try:
        return sre.parse(regex)
    except sre.error as e:
        raise ValueError(f"not a regular expression ({e})") from None
    except RecursionError:
        raise ValueError("its groups are nested too deeply to parse") from None


def group_depth(regex: str) -> int:
    """How deeply `regex`'s groups nest, counted without recursing: escapes and the
    parentheses inside character classes are skipped."""
    depth = deepest = i = 0
    while i < len(regex):
        c = regex[i]
        if c == "\\":
            i += 1
        elif c == "[":
            i += 2 if regex[i + 1:i + 2] == "^" else 1
            i += regex[i:i + 1] == "]"  # a leading ] is literal
            while i < len(regex) and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def refusal(regex: str) -> Optional[str]:
    """Why a user's `regex` is no regular expression a DFA can compile, or None. A
    ValueError when it does not parse or nests deeper than MAX_GROUP_DEPTH."""
    if group_depth(regex) > MAX_GROUP_DEPTH:
        raise ValueError(f"its groups are nested too deeply to parse (more than {MAX_GROUP_DEPTH} levels)")
    return _refusal(parse(regex))


def _look_around(op, av) -> str:
    kind = ("a look-ahead " + ("(?=...)" if op == C.ASSERT else "(?!...)") if av[0] >= 0
            else "a look-behind " + ("(?<=...)" if op == C.ASSERT else "(?<!...)"))
    return (f"{kind} is not supported: the constraint is compiled to a DFA (a regular language), which reads the "
            "answer once, left to right, and cannot look ahead or behind")


def _refusal(items: Sequence) -> Optional[str]:
    for op, av in items:
        if op in (C.ASSERT, C.ASSERT_NOT):
            return _look_around(op, av)
        if op in WHY:
            return WHY[op]
        if op == C.AT and av in AT_WHY:
            return AT_WHY[av]
        for sub in _children(op, av):
            why = _refusal(sub)
            if why:
                return why
    return None


def _children(op, av) -> List[Sequence]:
    if op == C.SUBPATTERN:
        return [av[3]]
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
        return [av[2]]
    if op == C.BRANCH:
        return list(av[1])
    if op in (C.ASSERT, C.ASSERT_NOT):
        return [av[1]]
    if op == C.ATOMIC_GROUP:
        return [av]
    return []


# --- character sets -------------------------------------------------------------------
def _norm(iv) -> Intervals:
    out: List[List[int]] = []
    for lo, hi in sorted(iv):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _complement(iv: Intervals) -> Intervals:
    out, nxt = [], 0
    for lo, hi in iv:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODE:
        out.append((nxt, MAX_CODE))
    return tuple(out)


# \d \s \w as their ASCII ranges: the count is the automaton's size over these classes,
# which their Unicode extent changes little
CATEGORIES = {C.CATEGORY_DIGIT: ((48, 57),), C.CATEGORY_SPACE: ((9, 13), (32, 32)),
              C.CATEGORY_WORD: ((48, 57), (65, 90), (95, 95), (97, 122))}
NOT_CATEGORIES = {C.CATEGORY_NOT_DIGIT: C.CATEGORY_DIGIT, C.CATEGORY_NOT_SPACE: C.CATEGORY_SPACE,
                  C.CATEGORY_NOT_WORD: C.CATEGORY_WORD}


def _casefold(iv: Intervals) -> Intervals:
    """`iv` with the other case of its ASCII letters (IGNORECASE)."""
    extra = []
    for lo, hi in iv:
        for a, b, shift in ((65, 90, 32), (97, 122, -32)):
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                extra.append((x + shift, y + shift))
    return _norm(list(iv) + extra)


def _charset(op, av, flags: int) -> Intervals:
    """The code points one LITERAL / NOT_LITERAL / ANY / IN item matches."""
    if op == C.ANY:
        return ((0, MAX_CODE),) if flags & C.SRE_FLAG_DOTALL else _complement(((10, 10),))
    negate, parts = op == C.NOT_LITERAL, []
    for o, a in ([(C.LITERAL, av)] if op in (C.LITERAL, C.NOT_LITERAL) else av):
        if o == C.NEGATE:
            negate = True
        elif o == C.LITERAL:
            parts.append((a, a))
        elif o == C.RANGE:
            parts.append(a)
        elif o == C.CATEGORY and a in CATEGORIES:
            parts.extend(CATEGORIES[a])
        elif o == C.CATEGORY and a in NOT_CATEGORIES:
            parts.extend(_complement(CATEGORIES[NOT_CATEGORIES[a]]))
        else:
            raise ValueError(f"unsupported character class item {o} {a}")
    iv = _norm(parts)
    if flags & C.SRE_FLAG_IGNORECASE:
        iv = _casefold(iv)
    return _complement(iv) if negate else iv


# --- the NFA and its determinization --------------------------------------------------
class _NFA:
    """Thompson's construction: every state has epsilon moves or one move on a character set."""

    def __init__(self, cap: int):
        self.eps: List[List[int]] = []
        self.move: List[Optional[Tuple[Intervals, int]]] = []
        self.cap = cap

    def new(self) -> int:
        if len(self.eps) >= self.cap:
            raise OverCap(f"its NFA has more than {self.cap:,} states ({NFA_PER_STATE} per state of the cap)")
        self.eps.append([])
        self.move.append(None)
        return len(self.eps) - 1

    def build(self, items: Sequence, flags: int) -> Tuple[int, int]:
        s = e = self.new()
        for op, av in items:
            a, b = self.item(op, av, flags)
            self.eps[e].append(a)
            e = b
        return s, e

    def item(self, op, av, flags: int) -> Tuple[int, int]:
        if op in (C.LITERAL, C.NOT_LITERAL, C.ANY, C.IN):
            s, e = self.new(), self.new()
            self.move[s] = (_charset(op, av, flags), e)
            return s, e
        if op == C.SUBPATTERN:
            return self.build(av[3], (flags | av[1]) & ~av[2])
        if op == C.BRANCH:
            s, e = self.new(), self.new()
            for alt in av[1]:
                a, b = self.build(alt, flags)
                self.eps[s].append(a)
                self.eps[b].append(e)
            return s, e
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            lo, hi, sub = av
            s = e = self.new()
            for _ in range(lo):
                a, b = self.build(sub, flags)
                self.eps[e].append(a)
                e = b
            end = self.new()
            if hi == C.MAXREPEAT:  # star: x*
                a, b = self.build(sub, flags)
                self.eps[e] += [a, end]
                self.eps[b] += [a, end]
            else:  # x(x(x)?)?)?: linear in hi - lo
                for _ in range(hi - lo):
                    a, b = self.build(sub, flags)
                    self.eps[e] += [a, end]
                    e = b
                self.eps[e].append(end)
            return s, end
        if op == C.AT and av in (C.AT_END, C.AT_END_LINE, C.AT_BEGINNING_LINE):
            s = self.new()
            return s, s
        raise ValueError(refusal_of(op, av))

    def closure(self, states) -> FrozenSet[int]:
        seen, stack = set(states), list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        return frozenset(seen)


def refusal_of(op, av) -> str:
    if op in (C.ASSERT, C.ASSERT_NOT):
        return _look_around(op, av)
    return WHY.get(op) or AT_WHY.get(av) or f"unsupported regex construct {op}"


def count_states(regex: str, cap: int) -> int:
    """The number of states of `regex`'s DFA (over the whole answer; the dead state not
    counted). Raises OverCap as soon as it passes `cap`, or once building it would track
    more than the cap's share of NFA states (NFA_PER_STATE, WORK_PER_STATE per state of
    the cap); a ValueError naming a construct no DFA expresses (`refusal`)."""
    parsed = parse(regex)
    why = _refusal(parsed)
    if why:
        raise ValueError(why)
    nfa = _NFA(NFA_PER_STATE * cap)
    start, _ = nfa.build(parsed, parsed.state.flags)  # acceptance does not change the count
    # the alphabet: the regex's character sets cut into the pieces no set splits
    points = sorted({p for m in nfa.move if m for lo, hi in m[0] for p in (lo, hi + 1)})
    moves: List[List[Tuple[range, int]]] = [[] for _ in nfa.move]
    for q, m in enumerate(nfa.move):
        if m:
            moves[q] = [(range(bisect.bisect_left(points, lo), bisect.bisect_left(points, hi + 1)), m[1])
                        for lo, hi in m[0]]
    first = nfa.closure([start])
    seen = {first: 0}
    todo, work, budget = [first], len(first), WORK_PER_STATE * cap
    while todo:
        cur = todo.pop()
        step: Dict[int, set] = {}
        for q in cur:
            for syms, t in moves[q]:
                for a in syms:
                    step.setdefault(a, set()).add(t)
        for targets in {frozenset(t) for t in step.values()}:
            nxt = nfa.closure(targets)
            if nxt not in seen:
                seen[nxt] = len(seen)
                work += len(nxt)
                if len(seen) > cap:
                    raise OverCap(f"its DFA has more than {cap:,} states")
                if work > budget:
                    raise OverCap(f"building its DFA tracks more than {budget:,} NFA states "
                                  f"({WORK_PER_STATE} per state of the cap)")
                todo.append(nxt)
    return len(seen)
