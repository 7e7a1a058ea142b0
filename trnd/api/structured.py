"""What a request asks the sampler to obey: `response_format`, vLLM's `structured_outputs`, and the
grammar `tool_choice` "required" / a named function imposes, turned into one GrammarSpec. Each is
compiled here, before the request is queued, so a schema llguidance cannot compile is a 400 naming
the field, never an unconstrained 200.
"""

from __future__ import annotations

import json

from trnd.api.errors import invalid
from trnd.api.tools import bounded
from trnd.sampling_params import GrammarSpec


def _schema_text(param: str, schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise invalid(param, f"{param} is not valid JSON: {e}") from None
    return json.dumps(bounded(schema))


def _from_response_format(rf) -> tuple[GrammarSpec | None, str]:
    if rf.type == "text":
        return None, "response_format"
    if rf.type == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}'), "response_format"
    if rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        if rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid(param, f"{param} is required for response_format type json_schema")
        return GrammarSpec(kind="json_schema", value=_schema_text(param, rf.json_schema.schema)), param
    raise invalid("response_format.type", f"response_format.type {rf.type!r} is not one of text, json_object, "
                                          "json_schema")


def _from_structured_outputs(so) -> tuple[GrammarSpec, str]:
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(so, k) not in (None, False)]
    if len(given) != 1:
        raise invalid("structured_outputs", "structured_outputs needs exactly one of json, regex, choice, grammar, "
                                            f"json_object (got {', '.join(given) or 'none'})")
    k = given[0]
    param = f"structured_outputs.{k}"
    if k == "json":
        return GrammarSpec(kind="json_schema", value=_schema_text(param, so.json)), param
    if k == "json_object":
        return GrammarSpec(kind="json_schema", value='{"type": "object"}'), param
    if k == "choice":
        if not so.choice:
            raise invalid(param, f"{param} must list at least one choice")
        return GrammarSpec(kind="choice", value=json.dumps(so.choice)), param
    return GrammarSpec(kind="regex" if k == "regex" else "ebnf", value=getattr(so, k)), param


def request_grammar(req, engine, tool_spec: GrammarSpec | None = None, after: str | None = None
                    ) -> GrammarSpec | None:
    """The one grammar of a request (None: unconstrained). The engine's llguidance side compiles it as a
    check, and is touched only here: a request without a grammar never loads llguidance or parses the
    tokenizer for it. `after` starts the grammar once reasoning has ended."""
    found: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec, param = _from_response_format(req.response_format)
        if spec is not None:
            found.append((spec, param))
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    if tool_spec is not None:
        found.append((tool_spec, "tool_choice"))
    if not found:
        return None
    if len(found) > 1:
        a, b = found[0][1].split(".")[0], found[1][1].split(".")[0]
        raise invalid(b, f"{b} cannot be combined with {a}: a reply follows one grammar")
    spec, param = found[0]
    why = engine.grammars.check(spec)
    if why is not None:
        raise invalid(param, f"{param} cannot be compiled to a grammar: {why}")
    if after is not None:
        spec = GrammarSpec(kind=spec.kind, value=spec.value, after=after)
    return spec
