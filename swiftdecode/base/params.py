"""Sampling parameters and their one validator, shared by the engine, the CLIs, the server and bench.

Torch-free, so the apps can check their input before anything heavy is imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from swiftdecode.base.errors import UserError

MAX_TOP_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's limit for chat completions)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI's
MAX_BIAS_IDS = 300  # token ids a logit_bias may name, as OpenAI's (each costs the sampler a scatter)
# The smallest temperature that samples: logits / T is computed in float32, where a smaller T (1e-300 rounds to 0)
# overflows to inf and the softmax to NaN. vLLM treats temperatures below this as greedy; we ask for 0 instead.
MIN_TEMPERATURE = 1e-5
TINY = f"0 (greedy) or at least {MIN_TEMPERATURE:g}"
# Characters a stop string may have: streaming holds back any end of the text that begins a stop string, checked
# every round at a cost that grows with the square of the string's length (OpenAI does not say; 1 KiB is ample).
MAX_STOP_CHARS = 1024
SHOWN = 80  # characters of a rejected value an error message repeats (a value may be megabytes long)
# The logit adjustments beyond temperature, top-p and top-k: keyword (= OpenAI/vLLM field, CLI flag) -> (value that
# turns it off, what it does). The CLIs and the server take them from here.
CONTROLS = {
    "presence_penalty": (0.0, "OpenAI's, in [-2, 2]: subtracted from the logit of every token generated so far"),
    "frequency_penalty": (0.0, "OpenAI's, in [-2, 2]: subtracted once per time a token was generated so far"),
    "repetition_penalty": (
        1.0,
        "transformers'/vLLM's, > 0: the logit of every token of the prompt or generated so far divided by it "
        "(multiplied where negative); 1 is off",
    ),
    "min_p": (0.0, "in [0, 1]: sampling drops tokens less likely than min_p times the likeliest (after top-p)"),
}


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # ... times how often it was generated
    repetition_penalty: float = 1.0  # divides the (positive) logits of the prompt's and generated tokens
    min_p: float = 0.0  # sampling keeps tokens at least min_p times as likely as the likeliest
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ascending ids
    min_tokens: int = 0  # end-of-sequence tokens are not picked before this many new tokens
    ignore_eos: bool = False  # an end-of-sequence token does not end the answer (only max_new_tokens or a stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a pick depends on the tokens before it (the penalties)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def truncated(self) -> bool:
        """Whether sampling draws from fewer tokens than the whole vocabulary."""
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass(frozen=True)
class RequestParams:
    """A request's parameters as `check_params` validated them: what the engine takes without checking again (it
    checks only what needs the model, `check_vocab`)."""

    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # alternatives per token (0-20); None: no logprobs


class ParamError(UserError):
    """A sampling parameter that breaks its rule; `field` is its `Generator.stream` keyword."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return _is_int(v) or isinstance(v, float)


def check_params(
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop: list[str] | None = None,
    names: Mapping[str, str] | None = None,
    logprobs: int | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    min_p: float = 0.0,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> RequestParams:
    """The validated RequestParams, or ParamError naming the first bad field as `names` spells it (keyword
    -> the caller's name, e.g. "--max-new-tokens"; default: the keyword itself). Token ids against the model's
    vocabulary are `check_vocab`'s."""
    stop_ok = stop is None or isinstance(stop, list) and all(_is_stop(s) for s in stop)
    rules = (  # (field, value, holds, what it must be); NaN fails every comparison, so it is rejected
        ("max_new_tokens", max_new_tokens, _is_int(max_new_tokens), "an integer"),
        ("max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 1, ">= 1"),
        ("temperature", temperature, _is_number(temperature), "a number"),
        ("temperature", temperature, _is_number(temperature) and 0 <= temperature < math.inf, "finite and >= 0"),
        ("temperature", temperature, temperature == 0 or _is_positive(temperature, MIN_TEMPERATURE), TINY),
        ("top_p", top_p, _is_number(top_p), "a number"),
        ("top_p", top_p, _is_number(top_p) and 0 < top_p <= 1, "in (0, 1]"),
        ("top_k", top_k, _is_int(top_k), "an integer"),
        ("top_k", top_k, _is_int(top_k) and top_k >= 0, ">= 0 (0 disables it)"),
        ("stop", stop, stop_ok, f"a list of non-empty strings of at most {MAX_STOP_CHARS} characters"),
        *penalty_rules(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty),
        ("repetition_penalty", repetition_penalty, _is_positive(repetition_penalty), "a finite number > 0 (1: off)"),
        ("min_p", min_p, _is_number(min_p) and 0 <= min_p <= 1, "a number in [0, 1]"),
        bias_rule(logit_bias, None),
        ("min_tokens", min_tokens, _is_int(min_tokens) and 0 <= min_tokens, "an integer >= 0"),
        ("min_tokens", min_tokens, not _is_int(max_new_tokens) or min_tokens <= max_new_tokens, "<= max_new_tokens"),
        ("ignore_eos", ignore_eos, isinstance(ignore_eos, bool), "true or false"),
        (
            "logprobs",
            logprobs,
            logprobs is None or _is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS,
            f"an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)",
        ),
    )
    _enforce(rules, names)
    bias = tuple(sorted((t, float(b)) for t, b in (logit_bias or {}).items()))
    sampling = SamplingParams(
        float(temperature),
        float(top_p),
        top_k,
        float(presence_penalty),
        float(frequency_penalty),
        float(repetition_penalty),
        float(min_p),
        bias,
        min_tokens,
        ignore_eos,
    )
    return RequestParams(max_new_tokens, sampling, tuple(stop or ()), logprobs)


def check_vocab(params: RequestParams, vocab: int) -> None:
    """The rule that needs the model: logit_bias's token ids lie below its vocabulary size (ParamError if not)."""
    _enforce([bias_rule(dict(params.sampling.logit_bias), vocab)])


def bias_rule(bias: object, vocab: int | None) -> tuple:
    """check_params' rule for logit_bias: {token id in [0, vocab): a number within MAX_LOGIT_BIAS}."""
    ids = "integers >= 0" if vocab is None else f"integers in [0, {vocab})"
    what = f"at most {MAX_BIAS_IDS} token ids ({ids}): numbers in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    return "logit_bias", bias, _bias_ok(bias, vocab), what


def _enforce(rules, names: Mapping[str, str] | None = None) -> None:
    """ParamError for the first (field, value, holds, what it must be) rule that does not hold."""
    for field, value, holds, what in rules:
        if not holds:
            raise ParamError(field, f"{(names or {}).get(field, field)} must be {what}, got {value!r:.{SHOWN}}")


def _is_positive(v: object, least: float = 0.0) -> bool:
    """A finite number > 0 (and >= `least`)."""
    return _is_number(v) and 0 < v < math.inf and v >= least


def _is_stop(s: object) -> bool:
    return isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS


def _bias_ok(bias: object, vocab: int | None) -> bool:
    """None, or {token id in [0, vocab): bias within MAX_LOGIT_BIAS}."""
    if bias is None:
        return True
    return (
        isinstance(bias, Mapping)
        and len(bias) <= MAX_BIAS_IDS
        and all(
            _is_int(t) and 0 <= t < (vocab or math.inf) and _is_number(b) and abs(b) <= MAX_LOGIT_BIAS
            for t, b in bias.items()
        )
    )


def penalty_rules(**penalties: float) -> list[tuple]:
    """check_params' rules for the penalties: numbers in [-MAX_PENALTY, MAX_PENALTY]."""
    what = f"a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    return [(f, v, _is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY, what) for f, v in penalties.items()]
