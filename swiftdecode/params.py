"""Sampling parameters and their one validator, shared by the engine, the CLIs, the server and bench.

Torch-free, so the apps can check their input before anything heavy is imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from swiftdecode.errors import UserError

MAX_TOP_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's limit for chat completions)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
PENALTIES = ("presence_penalty", "frequency_penalty")  # their keyword (and OpenAI field) names


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # ... times how often it was generated

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
) -> SamplingParams:
    """The validated SamplingParams, or ParamError naming the first bad field as `names` spells it (keyword
    -> the caller's name, e.g. "--max-new-tokens"; default: the keyword itself)."""
    stop_ok = stop is None or isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    rules = (  # (field, value, holds, what it must be); NaN fails every comparison, so it is rejected
        ("max_new_tokens", max_new_tokens, _is_int(max_new_tokens), "an integer"),
        ("max_new_tokens", max_new_tokens, _is_int(max_new_tokens) and max_new_tokens >= 1, ">= 1"),
        ("temperature", temperature, _is_number(temperature), "a number"),
        ("temperature", temperature, _is_number(temperature) and 0 <= temperature < math.inf, "finite and >= 0"),
        ("top_p", top_p, _is_number(top_p), "a number"),
        ("top_p", top_p, _is_number(top_p) and 0 < top_p <= 1, "in (0, 1]"),
        ("top_k", top_k, _is_int(top_k), "an integer"),
        ("top_k", top_k, _is_int(top_k) and top_k >= 0, ">= 0 (0 disables it)"),
        ("stop", stop, stop_ok, "a list of non-empty strings"),
        *penalty_rules(presence_penalty=presence_penalty, frequency_penalty=frequency_penalty),
        (
            "logprobs",
            logprobs,
            logprobs is None or _is_int(logprobs) and 0 <= logprobs <= MAX_TOP_LOGPROBS,
            f"an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)",
        ),
    )
    for field, value, holds, what in rules:
        if not holds:
            raise ParamError(field, f"{(names or {}).get(field, field)} must be {what}, got {value!r}")
    return SamplingParams(float(temperature), float(top_p), top_k, float(presence_penalty), float(frequency_penalty))


def penalty_rules(**penalties: float) -> list[tuple]:
    """check_params' rules for the penalties: numbers in [-MAX_PENALTY, MAX_PENALTY]."""
    what = f"a number in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    return [(f, v, _is_number(v) and -MAX_PENALTY <= v <= MAX_PENALTY, what) for f, v in penalties.items()]
