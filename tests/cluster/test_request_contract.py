"""One request contract: every bound is stated once, in engine/sampling_params.py's `BOUNDS`,
and a request is checked once, by the edge that builds its engine request.

- The HTTP schema's ranges are the table's (read from /openapi.json's JSON schema), and the HTTP
  edge and the Python driver's check (`SamplingParams.validate`) accept and refuse the same
  values at each end of every bound.
- No module that handles a request restates a bound: the source holds no numeric literal of a
  bound in a comparison or a pydantic constraint, and builds no `Bound` of its own, outside the
  table. The scan is shown to see each kind of restatement.
- The contract is checked at the edges only: `validate` where a Python caller builds its own
  request (the driver, `tandem generate`), `validate_relations` where the HTTP schema already
  held each field to its bound, and neither in the engine.
- Each error class is defined once, so one name has one meaning (the HTTP edge maps each class
  to a status once: tests/cluster/test_protocol.py).
"""

from __future__ import annotations

import ast
import asyncio
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from tandem.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tandem.engine.errors import InvalidRequestError
from tandem.engine.sampling_params import BOUNDS, Bound, SamplingParams

ROOT = Path(__file__).resolve().parents[2]
TABLE = "engine/sampling_params.py"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
# HTTP field -> (the table's name for it, the request models that have it).
BOTH = (CompletionRequest, ChatCompletionRequest)
HTTP_SCALARS = {
    "max_tokens": ("max_tokens", BOTH),
    "max_completion_tokens": ("max_tokens", (ChatCompletionRequest,)),
    "min_tokens": ("min_tokens", BOTH),
    "temperature": ("temperature", BOTH),
    "top_p": ("top_p", BOTH),
    "top_k": ("top_k", BOTH),
    "min_p": ("min_p", BOTH),
    "seed": ("seed", BOTH),
    "n": ("n", BOTH),
    "presence_penalty": ("presence_penalty", BOTH),
    "frequency_penalty": ("frequency_penalty", BOTH),
    "repetition_penalty": ("repetition_penalty", BOTH),
    "logprobs": ("logprobs", (CompletionRequest,)),
    "top_logprobs": ("logprobs", (ChatCompletionRequest,)),
    "priority": ("priority", BOTH),
    "ttft_deadline_ms": ("ttft_deadline_ms", BOTH),
}
UNBOUNDED_SAMPLING_FIELDS = {"ignore_eos", "structured_output"}  # a flag, and a grammar (its own checks)


# -- the table covers the contract -----------------------------------------------------------------
def test_every_sampling_field_has_its_bound_in_the_table():
    from dataclasses import fields

    names = {f.name for f in fields(SamplingParams)}
    assert names - UNBOUNDED_SAMPLING_FIELDS <= set(BOUNDS), "a sampling field without a bound"
    http_only = {name for name, _ in HTTP_SCALARS.values()} | {"prompt_token_ids"}
    assert set(BOUNDS) <= names | http_only, "a bound no request field has"


# -- the HTTP schema takes its ranges from the table -----------------------------------------------
def schema_of(bound: Bound) -> dict:
    """The JSON schema pydantic writes for a value within `bound`."""
    schema = {"type": "integer" if bound.kind is int else "number"}
    if bound.low is not None:
        schema["exclusiveMinimum" if bound.low_open else "minimum"] = bound.low
    if bound.high is not None:
        schema["exclusiveMaximum" if bound.high_open else "maximum"] = bound.high
    return schema


def constrained(prop: dict) -> dict:
    """A property's non-null branch, with only the keys that state a type or a range."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    assert len(branches) == 1, prop
    keys = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
    return {k: branches[0][k] for k in keys if k in branches[0]}


@pytest.mark.parametrize("field", HTTP_SCALARS)
def test_each_http_range_is_the_tables(field):
    name, models = HTTP_SCALARS[field]
    for model in models:
        prop = model.model_json_schema()["properties"][field]
        assert constrained(prop) == schema_of(BOUNDS[name]), f"{model.__name__}.{field}"


def test_each_http_list_and_token_id_is_the_tables():
    props = CompletionRequest.model_json_schema()["properties"]
    ids = [b for b in props["stop_token_ids"]["anyOf"] if b.get("type") == "array"][0]
    assert constrained(ids["items"]) == schema_of(BOUNDS["stop_token_ids"])
    assert ids["maxItems"] == BOUNDS["stop_token_ids"].max_items
    bias = [b for b in props["logit_bias"]["anyOf"] if b.get("type") == "object"][0]
    assert constrained(bias["additionalProperties"]) == schema_of(BOUNDS["logit_bias"])
    assert bias["maxProperties"] == BOUNDS["logit_bias"].max_items
    prompts = [b for b in props["prompt"]["anyOf"] if b.get("type") == "array"]
    token_lists = [b["items"] for b in prompts if b["items"].get("type") == "integer"]
    token_lists += [b["items"]["items"] for b in prompts if b["items"].get("type") == "array"]
    assert len(token_lists) == 2
    assert all(constrained(items) == schema_of(BOUNDS["prompt_token_ids"]) for items in token_lists)


# -- the HTTP edge and the driver agree at every end -----------------------------------------------
def step(bound: Bound, x: float, toward: float) -> float:
    if bound.kind is int:
        return x + (1 if toward > x else -1)
    return math.nextafter(x, toward)


def ends(bound: Bound) -> list[tuple[float, bool]]:
    """(value, admitted) just inside and just outside each finite end."""
    cases = []
    for end, outward, is_open in ((bound.low, -math.inf, bound.low_open), (bound.high, math.inf, bound.high_open)):
        if end is None:
            continue
        inward = -outward
        cases.append((step(bound, end, inward) if is_open else end, True))
        cases.append((end if is_open else step(bound, end, outward), False))
    return cases


def http_admits(model: type, field: str, value: object) -> bool:
    body = {**(CHAT if model is ChatCompletionRequest else COMPLETION), field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


def driver_admits(**settings: object) -> bool:
    try:
        SamplingParams(**settings).validate()
    except InvalidRequestError:
        return False
    return True


def sampling_settings(name: str, value: object) -> dict:
    """`name` set to `value`, and whatever a relation between fields needs to let it stand alone."""
    return {name: value, **({"max_tokens": BOUNDS["max_tokens"].high} if name == "min_tokens" else {})}


@pytest.mark.parametrize("field", HTTP_SCALARS)
def test_the_http_edge_and_the_driver_agree_at_each_end(field):
    name, models = HTTP_SCALARS[field]
    bound = BOUNDS[name]
    wrong_types = [True] + ([float(bound.low)] if bound.kind is int else ["1"])
    for value, admitted in ends(bound) + [(v, False) for v in wrong_types]:
        for model in models:
            assert http_admits(model, field, value) is admitted, f"HTTP {model.__name__}.{field}={value!r}"
        if name != "ttft_deadline_ms":  # the router's, not a sampling setting: the HTTP edge's alone
            assert driver_admits(**sampling_settings(name, value)) is admitted, f"driver {name}={value!r}"


def test_the_deadline_header_takes_the_bodys_bound():
    from tandem.cluster.headers import DEADLINE_HEADER
    from tandem.cluster.request_edge import ttft_deadline_s

    class Request:
        def __init__(self, value: float) -> None:
            self.headers = {DEADLINE_HEADER: repr(value)}

    body = CompletionRequest.model_validate(COMPLETION)
    for value, admitted in ends(BOUNDS["ttft_deadline_ms"]):
        try:
            ttft_deadline_s(Request(value), body)
        except InvalidRequestError:
            assert not admitted, value
        else:
            assert admitted, value


def test_lists_and_maps_agree_at_each_end():
    ids, bias, stop = BOUNDS["stop_token_ids"], BOUNDS["logit_bias"], BOUNDS["stop"]
    token_id = bias.keys
    cases = [  # (HTTP field, HTTP value, driver value, admitted)
        *[("stop_token_ids", [v], [v], ok) for v, ok in ends(ids)],
        ("stop_token_ids", [0] * ids.max_items, [0] * ids.max_items, True),
        ("stop_token_ids", [0] * (ids.max_items + 1), [0] * (ids.max_items + 1), False),
        *[("logit_bias", {"5": v}, {5: v}, ok) for v, ok in ends(bias)],
        *[("logit_bias", {str(v): 1.0}, {v: 1.0}, ok) for v, ok in ends(token_id) if v >= 0],
        ("logit_bias", {str(i): 1.0 for i in range(bias.max_items)}, {i: 1.0 for i in range(bias.max_items)}, True),
        ("logit_bias", {str(i): 1.0 for i in range(bias.max_items + 1)},
         {i: 1.0 for i in range(bias.max_items + 1)}, False),
        ("stop", [""], [""], False),
        ("stop", ["x"] * stop.max_items, ["x"] * stop.max_items, True),
        ("stop", ["x"] * (stop.max_items + 1), ["x"] * (stop.max_items + 1), False),
    ]
    for field, http_value, driver_value, admitted in cases:
        assert http_admits(CompletionRequest, field, http_value) is admitted, f"HTTP {field}={http_value!r:.80}"
        assert driver_admits(**{field: driver_value}) is admitted, f"driver {field}={driver_value!r:.80}"


def test_out_of_range_errors_name_the_field():
    with pytest.raises(InvalidRequestError, match=r"temperature must be a number in \[0, 2\], got 3") as info:
        SamplingParams(temperature=3).validate()
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError, match="min_tokens") as info:
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    assert info.value.param == "min_tokens"


# -- no bound is stated twice ----------------------------------------------------------------------
CONSTRAINT_KEYWORDS = {"ge", "gt", "le", "lt", "max_length", "min_length"}
# Too common to be read as a bound's: a literal 0, 1 or -1 is a bound's only by context.
COMMON = {-1, 0, 1}
# The modules that must be scanned (each parses, builds or checks a request).
REQUEST_PATH = {"cluster/protocol.py", "cluster/app.py", "cluster/request_edge.py", "cluster/launcher.py",
                "engine/llm_engine.py", "engine/admission.py", "engine/cli.py", TABLE}


def bound_values() -> set[float]:
    values = set()
    for bound in BOUNDS.values():
        for b in (bound, bound.keys):
            if b is not None:
                values |= {v for v in (b.low, b.high, b.max_items) if v is not None}
    return values - COMMON


def number(node: ast.AST) -> float | None:
    """The value of a numeric literal, folded through signs and arithmetic (`2**31 - 1`)."""
    if isinstance(node, ast.Constant):
        value = node.value
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = number(node.operand)
        return None if value is None else (-value if isinstance(node.op, ast.USub) else value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Pow)):
        left, right = number(node.left), number(node.right)
        if left is None or right is None or (isinstance(node.op, ast.Pow) and abs(right) > 128):
            return None
        return {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right,
                ast.Pow: lambda: left ** right}[type(node.op)]()
    return None


def restated_bounds(path: Path, relative: str) -> list[str]:
    """Where a file states a bound itself: a bound's literal compared with, or given to pydantic
    as a constraint, or a `Bound` built outside the table."""
    values, found = bound_values(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg in CONSTRAINT_KEYWORDS:
            operands = [node.value]
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Bound":
            if relative != TABLE:
                found.append(f"{relative}:{node.lineno} builds a Bound outside the table")
            continue
        else:
            continue
        for operand in operands:
            value = number(operand)
            if value is not None and value in values:
                found.append(f"{relative}:{operand.lineno} states {value!r}")
    return sorted(found, key=lambda line: int(line.split(":")[1].split()[0]))


def request_path_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every product module that handles a request (it imports the contract or the HTTP schema),
    and the table's own module."""
    modules = {}
    for layer in ("engine", "actors", "cluster"):
        for path in sorted((root / layer).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            text = path.read_text()
            if relative == TABLE or "tandem.engine.sampling_params" in text or "tandem.cluster.protocol" in text:
                modules[relative] = path
    return modules


def test_no_module_on_the_request_path_restates_a_bound():
    modules = request_path_modules()
    assert REQUEST_PATH <= set(modules), "the scan must cover the modules that parse, build or check a request"
    assert [line for relative, path in modules.items() for line in restated_bounds(path, relative)] == []


def test_the_scan_sees_each_kind_of_restated_bound(tmp_path):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "x.py").write_text(
        "from tandem.cluster.protocol import CompletionRequest\n"
        "temperature: float = Field(default=1.0, ge=0.0, le=2.0)\n"
        "if len(body.logit_bias) > 300:\n"
        "    pass\n"
        "if not 0 < deadline_ms <= 86_400_000:\n"
        "    pass\n"
        "seed: int = Field(le=2**64 - 1)\n"
        "n = Bound(int, 1, 16)\n"
        "if params.n > 1 and x.ndim == 2 * 0:\n"  # 1 and 0 are not read as bounds
        "    pass\n")
    (tmp_path / "cluster" / "y.py").write_text("if x <= 2.0:\n    pass\n")  # not on the request path
    modules = request_path_modules(tmp_path)
    assert list(modules) == ["cluster/x.py"]
    assert restated_bounds(modules["cluster/x.py"], "cluster/x.py") == [
        "cluster/x.py:2 states 2.0",
        "cluster/x.py:3 states 300",
        "cluster/x.py:5 states 86400000",
        "cluster/x.py:7 states 18446744073709551615",
        "cluster/x.py:8 builds a Bound outside the table",
    ]


# -- checked once, at the edge ---------------------------------------------------------------------
def check_calls(root: Path = ROOT) -> set[tuple[str, str]]:
    """(file, method) for every call of `validate` or `validate_relations` in the product."""
    calls = set()
    for layer in ("engine", "routing", "actors", "cluster"):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("validate", "validate_relations")):
                    calls.add((path.relative_to(root).as_posix(), node.func.attr))
    return calls


def test_the_contract_is_checked_at_the_edges_only():
    assert check_calls() == {
        ("cluster/launcher.py", "validate"),  # the Python driver builds its own request
        ("engine/cli.py", "validate"),  # so does `tandem generate`
        ("cluster/request_edge.py", "validate_relations"),  # the HTTP schema held each field to its bound
        (TABLE, "validate_relations"),  # `validate` ends with the relations
    }


def test_the_driver_refuses_a_bad_request_before_routing_it():
    from tandem.cluster.config import TandemConfig
    from tandem.cluster.launcher import Tandem

    tandem = Tandem(router=None, backends={}, config=TandemConfig())  # no router: routing would fail
    with pytest.raises(InvalidRequestError, match="temperature"):
        asyncio.run(tandem.agenerate([1, 2, 3], SamplingParams(temperature=2.5)).__anext__())


# -- one class per error meaning -------------------------------------------------------------------
BUILTIN_ERRORS = {"Exception", "RuntimeError", "ValueError", "TypeError", "KeyError", "OSError"}


def error_classes(root: Path = ROOT) -> dict[str, list[str]]:
    """Exception class name -> the product files that define a class of that name."""
    bases: dict[tuple[str, str], set[str]] = {}
    for layer in ("engine", "routing", "actors", "cluster"):
        for path in sorted((root / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    names = {b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                             if isinstance(b, (ast.Name, ast.Attribute))}
                    bases[(node.name, path.relative_to(root).as_posix())] = names
    errors = set(BUILTIN_ERRORS)
    while True:  # a class is an error if a base is
        more = {name for (name, _), names in bases.items() if names & errors} - errors
        if not more:
            break
        errors |= more
    found: dict[str, list[str]] = {}
    for name, relative in sorted(bases):
        if name in errors - BUILTIN_ERRORS:
            found.setdefault(name, []).append(relative)
    return found


def test_each_error_class_is_defined_once():
    """One meaning, one class: routing's refusal of a deadline is not engine/errors.py's
    `DeadlineUnmetError` (the 429 a caller sees), so it has its own name."""
    found = error_classes()
    assert {"DeadlineUnmetError", "DeadlineRefusedError", "InvalidRequestError"} <= set(found)
    assert {name: files for name, files in found.items() if len(files) > 1} == {}


def test_a_second_class_of_one_name_is_seen(tmp_path):
    for layer, text in (("engine", "class TandemError(Exception):\n    pass\n"
                                   "class DeadlineUnmetError(TandemError):\n    pass\n"),
                        ("routing", "class DeadlineUnmetError(RuntimeError):\n    pass\n")):
        (tmp_path / layer).mkdir()
        (tmp_path / layer / "errors.py").write_text(text)
    assert error_classes(tmp_path) == {"DeadlineUnmetError": ["engine/errors.py", "routing/errors.py"],
                                       "TandemError": ["engine/errors.py"]}
