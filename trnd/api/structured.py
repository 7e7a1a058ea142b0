"""What a request asks the sampler to obey: `response_format`, vLLM's `structured_outputs` (SGLang's `regex`,
`ebnf`, `json_schema`), and the
grammar `tool_choice` "required" / a named function imposes, turned into one GrammarSpec. Each is
compiled here, before the request is queued, so a schema llguidance cannot compile is a 400 naming
the field, never an unconstrained 200.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass

from trnd.api.errors import invalid
from trnd.api.tools import bounded
from trnd.sampling_params import GrammarSpec


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (APIConfig max_grammar_chars, max_grammar_depth,
    grammar_compile_s; docs/API.md). Each refusal is a 400 naming the field and the limit."""
    chars: int = 262_144  # the schema / regex / grammar text
    depth: int = 64  # JSON nesting of a schema (a tool's parameters too)
    compile_s: float = 10.0  # compiling it, on a worker thread
    repeat: int = 100_000  # a regex's bounded repetitions, expanded (llguidance's lexer builds states for each)

    @classmethod
    def of(cls, cfg) -> "GrammarLimits":
        return cls(cfg.max_grammar_chars, cfg.max_grammar_depth, cfg.grammar_compile_s)


DEFAULT_LIMITS = GrammarLimits()


def json_depth(value) -> int:
    """Nesting depth of decoded JSON (a scalar is 0), without recursion (a 400-deep schema must not recurse)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        kids = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        for k in kids:
            if isinstance(k, (dict, list)):
                stack.append((k, d + 1))
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
    return deepest


def regex_expansion(pattern: str) -> int | None:
    """How many times the regex's innermost pieces repeat once its bounded repetitions are expanded
    (`(a{1000}){1000}`: 1,000,000); None where Python's parser reads it otherwise than llguidance would."""
    try:
        import re._parser as sre
    except ImportError:  # pragma: no cover (Python < 3.11)
        import sre_parse as sre
    try:
        tree = sre.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None

    def size(items) -> int:
        total = 0
        for op, av in items:
            if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
                lo, hi, sub = av
                total += size(sub) * (max(lo, 1) if hi == sre.MAXREPEAT else hi)
            elif op is sre.SUBPATTERN:
                total += size(av[-1])
            elif op is sre.BRANCH:
                total += max((size(b) for b in av[1]), default=0)
            elif op in (sre.ASSERT, sre.ASSERT_NOT):
                total += size(av[1])
            else:
                total += 1
        return total
    return size(tree)


def _check_size(param: str, text: str, limits: GrammarLimits) -> None:
    if len(text) > limits.chars:
        raise invalid(param, f"{param} is {len(text)} characters; at most {limits.chars} are allowed "
                             f"(max_grammar_chars)")


def check_depth(param: str, value, limits: GrammarLimits) -> None:
    depth = json_depth(value)
    if depth > limits.depth:
        raise invalid(param, f"{param} is nested {depth} deep; at most {limits.depth} levels are allowed "
                             f"(max_grammar_depth)")


def _schema_text(param: str, schema, limits: GrammarLimits = DEFAULT_LIMITS) -> str:
    """The schema's canonical text (compact JSON, its keys in the client's order: property order is output
    order): what the engine caches compiled grammars by."""
    if isinstance(schema, str):
        _check_size(param, schema, limits)
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise invalid(param, f"{param} is not valid JSON: {e}") from None
    check_depth(param, schema, limits)
    text = json.dumps(bounded(schema), separators=(",", ":"))
    _check_size(param, text, limits)
    return text


def _from_response_format(rf, limits: GrammarLimits) -> tuple[GrammarSpec | None, str]:
    if rf.type == "text":
        return None, "response_format"
    if rf.type == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}'), "response_format"
    if rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid(param, f"{param} is required for response_format type json_schema")
        return GrammarSpec(kind="json_schema", value=_schema_text(param, rf.json_schema.schema, limits)), param
    raise invalid("response_format.type", f"response_format.type {rf.type!r} is not one of text, json_object, "
                                          "json_schema")


def _from_structured_outputs(so, limits: GrammarLimits) -> tuple[GrammarSpec, str]:
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs", "structured_outputs needs exactly one of json, regex, choice, grammar, "
                                            f"json_object (got {', '.join(given) or 'none'})")
    k = given[0]
    param = f"structured_outputs.{k}"
    if k == "json":
        return GrammarSpec(kind="json_schema", value=_schema_text(param, so.json, limits)), param
    if k == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}'), param
    if k == "choice":
        if not so.choice:
            raise invalid(param, f"{param} must list at least one choice")
        choice = json.dumps(so.choice)
        _check_size(param, choice, limits)
        return GrammarSpec(kind="choice", value=choice), param
    text = getattr(so, k)
    _check_size(param, text, limits)
    if k == "regex":
        n = regex_expansion(text)
        if n is not None and n > limits.repeat:
            raise invalid(param, f"{param}: its bounded repetitions expand to {n} pieces, more than the grammar "
                                 f"engine can enforce (at most {limits.repeat}); write an unbounded repetition "
                                 "(* or +) and bound the length with max_tokens")
    return GrammarSpec(kind="regex" if k == "regex" else "ebnf", value=text), param


def find_grammar(req, tool_spec: GrammarSpec | None = None, after: str | None = None,
                 limits: GrammarLimits = DEFAULT_LIMITS) -> tuple[GrammarSpec, str] | None:
    """The one grammar of a request and the field it came from (None: unconstrained), with its size, depth
    and regex limits checked; not compiled yet (compile_grammar). `after` starts the grammar once reasoning
    has ended."""
    found: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec, param = _from_response_format(req.response_format, limits)
        if spec is not None:
            found.append((spec, param))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs, limits))
    # SGLang's top-level names for the same constraints, under the same limits
    for name in ("regex", "ebnf"):
        text = getattr(req, name, None)
        if text is not None:
            _check_size(name, text, limits)
            n = regex_expansion(text) if name == "regex" else None
            if n is not None and n > limits.repeat:
                raise invalid(name, f"{name}: its bounded repetitions expand to {n} pieces, more than the grammar "
                                    f"engine can enforce (at most {limits.repeat}); write an unbounded repetition "
                                    "(* or +) and bound the length with max_tokens")
            found.append((GrammarSpec(kind=name, value=text), name))
    if getattr(req, "json_schema", None) is not None:  # completions only
        found.append((GrammarSpec(kind="json_schema", value=_schema_text("json_schema", req.json_schema, limits)),
                      "json_schema"))
    if tool_spec is not None:
        for i, t in enumerate(getattr(req, "tools", None) or []):
            if t.function.parameters is not None:
                check_depth(f"tools[{i}].function.parameters", t.function.parameters, limits)
        _check_size("tool_choice", tool_spec.value, limits)
        found.append((tool_spec, "tool_choice"))
    if not found:
        return None
    if len(found) > 1:
        a, b = found[0][1].split(".")[0], found[1][1].split(".")[0]
        raise invalid(b, f"{b} cannot be combined with {a}: a reply follows one grammar")
    spec, param = found[0]
    if after is not None:
        spec = GrammarSpec(kind=spec.kind, value=spec.value, after=after)
    return spec, param


def request_grammar(req, engine, tool_spec: GrammarSpec | None = None, after: str | None = None
                    ) -> GrammarSpec | None:
    """find_grammar, compiled here on the calling thread (the offline LLM, tests). The engine's llguidance
    side is touched only once a request has a grammar: a request without one never loads llguidance."""
    found = find_grammar(req, tool_spec, after)
    if found is None:
        return None
    spec, param = found
    why = engine.grammars.check(spec)
    if why is not None:
        raise invalid(param, f"{param} cannot be compiled to a grammar: {why}")
    return spec


_compiling = threading.Semaphore(1)  # one grammar compiled at a time, off the serving threads (any event loop)


async def compile_grammar(engine, found: tuple[GrammarSpec, str] | None, limits: GrammarLimits) -> GrammarSpec | None:
    """Compile on a worker thread (the engine keeps it, by its canonical text, for the engine thread and for
    the next request that sends it), within limits.compile_s: a grammar that takes longer is a 400 naming
    grammar_compile_s, and the event loop and the engine serve the others meanwhile. One compile runs at a
    time; the next waits for the core, inside its own time limit."""
    if found is None:
        return None
    spec, param = found
    grammars = engine.grammars  # loads llguidance on first use
    if grammars.cached(spec):
        return spec
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limits.compile_s

    def work() -> str | None | bool:
        if not _compiling.acquire(timeout=max(0.0, deadline - loop.time())):
            return False
        try:
            return grammars.check(spec)
        finally:
            _compiling.release()

    job = loop.run_in_executor(None, work)
    try:
        async with asyncio.timeout_at(deadline):
            why = await asyncio.shield(job)
    except TimeoutError:
        why = False
    if why is False:
        raise invalid(param, f"{param}: compiling its grammar took over {limits.compile_s:g} s "
                             "(grammar_compile_s)") from None
    if why is not None:
        raise invalid(param, f"{param} cannot be compiled to a grammar: {why}")
    return spec
