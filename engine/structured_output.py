"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regex
or one of a list of strings, through xgrammar.

The grammar work is xgrammar's (the default of vLLM and SGLang): it compiles a schema into a
grammar with a per-token mask cache once, and a per-request matcher then fills a step's token
bitmask in microseconds (docs/benchmarks/structured-output.md measures it against llguidance:
about five times cheaper per step on SmolLM2's vocabulary, at batch 4 and 64). Each piece
below is one small job:

- `StructuredOutputParams`: what a request asks for, a frozen (hashable, picklable) value that
  rides on `SamplingParams` from the HTTP edge to the engine and keys the compile cache.
- `GrammarCompiler`: one per engine, built lazily on the first structured request (xgrammar
  reads the whole vocabulary then, a fraction of a second); compiled grammars are cached by
  their params (at most 256, least recently used out; ~60 KB each on SmolLM2's vocabulary), so
  a schema sent again costs only a new matcher. Compiling runs in `add_request`, on the step
  loop's thread: a new schema holds that engine's steps for its compile time (~8 ms for a
  5-field schema on SmolLM2's vocabulary).
- `RequestGrammar`: one per request, the three calls the sampler and the engine make
  (`fill_bitmask`, `accept_token`, `is_terminated`).
- `apply_grammars` / `apply_token_bitmask`: the sampler's call. Rows without a grammar are not
  touched. xgrammar's kernel does the masking where it has one (C++ on CPU, Triton on CUDA);
  `apply_token_bitmask_torch` is the reference any device can run, and a test says they agree.

xgrammar is one of Tandem's dependencies; should an installation lack it, this module still
imports, and a request asking for structured output is refused with `InvalidRequestError`
(a 400) saying the installation is broken and how to repair it. torch and xgrammar are imported inside the functions that
use them, so `SamplingParams` (and the scheduler's request state) stay torch-free.

The output is always held to the whole schema (xgrammar's strict mode: an object schema
without `additionalProperties` allows no other keys). A schema keyword the grammar would
silently not enforce (`not`, `if`/`then`/`else`, `uniqueItems`, `dependentRequired`,
`dependentSchemas`, an `allOf` of several schemas) is refused rather than ignored. `oneOf` is
enforced as `anyOf` (one of the options matches; exclusivity is not checked).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

INSTALL_HINT = ("structured outputs need the xgrammar package, a dependency of tandem that this server's "
                "installation lacks or cannot import: the install is broken; reinstall tandem, or "
                "pip install 'xgrammar>=0.2.9' into its environment")
MAX_CACHED_GRAMMARS = 256
# Keywords xgrammar accepts without enforcing them: refused, so no constraint is dropped silently.
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "dependentRequired", "dependentSchemas")
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("additionalProperties", "items", "contains", "propertyNames", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
# "[03:00:33] /project/cpp/json_schema_converter.cc:5082: " before xgrammar's own message.
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one constraint. `json_schema` is the schema's canonical JSON text (sorted keys,
    no spaces: `from_json_schema` makes it), so equal schemas share one cache entry."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        kinds = [self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(kinds) != 1:
            raise InvalidRequestError("structured output takes exactly one of a JSON schema, json_object, "
                                      "a regex or a choice")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("guided_choice must be a non-empty list of non-empty strings")
        if self.regex is not None and not self.regex:
            raise InvalidRequestError("guided_regex must not be empty")

    @classmethod
    def from_json_schema(cls, schema: Any) -> StructuredOutputParams:
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be a JSON object")
        check_enforceable(schema)
        return cls(json_schema=json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @property
    def kind(self) -> str:
        if self.json_schema is not None:
            return "json_schema"
        if self.json_object:
            return "json_object"
        return "regex" if self.regex is not None else "choice"


def check_enforceable(schema: Any, path: str = "schema") -> None:
    """Refuse a schema keyword the grammar would not enforce, naming where it is."""
    if not isinstance(schema, dict):
        return
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            raise InvalidRequestError(f"{path}: the JSON schema keyword {keyword!r} cannot be enforced "
                                      "while generating; remove it")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        raise InvalidRequestError(f"{path}: allOf with more than one schema cannot be enforced while "
                                  "generating; merge them into one")
    for keyword in _SUBSCHEMA:
        check_enforceable(schema.get(keyword), f"{path}.{keyword}")
    for keyword in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(keyword), list):
            for i, sub in enumerate(schema[keyword]):
                check_enforceable(sub, f"{path}.{keyword}[{i}]")
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, sub in schema[keyword].items():
                check_enforceable(sub, f"{path}.{keyword}.{name}")


class RequestGrammar:
    """One request's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row_index: int) -> None:
        """Write the allowed next tokens into row `row_index` of a CPU int32 bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row_index)

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """The output is complete and its stop token (EOS) was accepted."""
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles `StructuredOutputParams` for one tokenizer and vocabulary, caching the results."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_cached: int = MAX_CACHED_GRAMMARS, max_threads: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the width of the logits the sampler masks
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_cached = max_cached
        self.max_threads = max_threads
        self.num_compiled = 0
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutputParams, Any] = OrderedDict()

    def make_grammar(self, params: StructuredOutputParams) -> RequestGrammar:
        compiled = self.compile(params)  # first: it says the install is broken if xgrammar is missing
        import xgrammar

        return RequestGrammar(xgrammar.GrammarMatcher(compiled))

    def compile(self, params: StructuredOutputParams) -> Any:
        """The compiled grammar for `params` (cached); `InvalidRequestError` naming the problem."""
        compiled = self._cache.get(params)
        if compiled is not None:
            self._cache.move_to_end(params)
            return compiled
        compiled = self._compile(params)
        self.num_compiled += 1
        self._cache[params] = compiled
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputParams) -> Any:
        compiler = self._xgrammar_compiler()
        try:
            if params.json_schema is not None:
                return compiler.compile_json_schema(params.json_schema, any_whitespace=False, strict_mode=True)
            if params.json_object:
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=True)
            if params.regex is not None:
                return compiler.compile_regex(params.regex)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(f"the {params.kind} could not be compiled into a grammar: "
                                      f"{_xgrammar_message(exc)}") from None

    def _xgrammar_compiler(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError as exc:
                raise InvalidRequestError(f"{INSTALL_HINT} ({exc})") from None
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=list(self.stop_token_ids))
            # Our cache is bounded; xgrammar's own would keep every schema ever sent.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler


def _xgrammar_message(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_LOG_PREFIX.sub("", first)[:300]


# -- masking ---------------------------------------------------------------------------------
def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmask(grammars: list[RequestGrammar | None], vocab_size: int, pin_memory: bool = False,
                 on_error: Callable[[int, Exception], None] | None = None) -> torch.Tensor:
    """A CPU int32 bitmask [len(grammars), words], each grammar's row filled, the others all ones.
    With `on_error`, a grammar that raises is that row's fault alone: its row is left all ones
    and `on_error(row, exception)` is called, and the other rows are filled; without, it raises."""
    import torch

    bitmask = torch.full((len(grammars), bitmask_width(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)
    for i, grammar in enumerate(grammars):
        if grammar is None:
            continue
        if on_error is None:
            grammar.fill_bitmask(bitmask, i)
            continue
        try:
            grammar.fill_bitmask(bitmask, i)
        except Exception as exc:
            bitmask[i] = -1  # whatever it wrote before failing
            on_error(i, exc)
    return bitmask


def apply_grammars(logits: torch.Tensor, grammars: list[RequestGrammar | None],
                   on_error: Callable[[int, Exception], None] | None = None) -> torch.Tensor:
    """The sampler's call: mask, in place, each row's logits to the tokens its grammar allows
    next. The bitmask is filled on the host while the device may still be computing the logits
    (the forward was only enqueued), then copied over in one transfer. `on_error`: as for
    `fill_bitmask` (a failed grammar's row is left unmasked; the caller fails its request)."""
    rows = [i for i, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return logits
    bitmask = fill_bitmask(grammars, logits.shape[-1], pin_memory=logits.device.type == "cuda", on_error=on_error)
    apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` whose bit is 0 (bitmask rows align with logits
    rows; bit j of word w is token 32*w + j). xgrammar's kernel when it has one for this device
    and dtype, else the torch reference."""
    if _has_xgrammar_kernel(logits):
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    else:
        apply_token_bitmask_torch(logits, bitmask, rows)


def _has_xgrammar_kernel(logits: torch.Tensor) -> bool:
    import torch

    if not logits.is_contiguous():  # a vocab slice of wider logits: the reference handles strides
        return False
    if logits.device.type == "cpu" and logits.dtype != torch.float32:
        return False
    if logits.device.type not in ("cpu", "cuda"):
        return False
    try:
        import xgrammar  # noqa: F401  (already imported once any grammar exists)
    except ImportError:
        return False
    return True


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The reference: unpack the bits of `rows` with tensor ops (any device, no host sync)."""
    import torch

    vocab_size = logits.shape[-1]
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    words = bitmask.to(logits.device).index_select(0, index)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    masked = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
