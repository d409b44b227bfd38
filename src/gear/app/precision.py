"""Which precision a run uses: bf16 autocast only where the hardware runs bf16 natively.

On a CPU without bf16 instructions (AVX2-only x86, and AVX512 without the BF16 extension) bf16
autocast is emulated: every matmul converts to and from float32 around float32 arithmetic. On
an AVX2 EPYC a SmolLM2-135M forward took 3.7x longer under bf16 autocast than in float32, and a
`gear train` step 10x longer. So `bf16: auto` (gear's default) means:

- CUDA: bf16 when `torch.cuda.is_bf16_supported()` (Ampere and newer), else float32;
- x86 CPU: bf16 when the CPU has the `avx512_bf16` or `amx_bf16` flag (Linux `/proc/cpuinfo`);
- ARM CPU: bf16 when it has the `bf16` feature (`/proc/cpuinfo` "Features");
- elsewhere (no `/proc/cpuinfo`, e.g. macOS): `torch.ops.mkldnn._is_mkldnn_bf16_supported()`.

`torch.backends.cpu.get_cpu_capability()` ("AVX2", "AVX512", ...) is recorded but cannot decide:
AVX512 CPUs without the BF16 extension report "AVX512" too, and oneDNN's own check says yes on
any AVX512 core, where bf16 is still emulated.

`bf16: true` / `false` are honoured as given; `true` on an emulating CPU gets a warning line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NATIVE_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags; "bf16": ARM feature


@dataclass(frozen=True)
class Precision:
    """The precision of one run, and why.

    bf16: whether the trainer runs bf16 autocast (TRL/accelerate `bf16=True`): the training
        forward and backward, generation (accelerate wraps the model's forward) and the GEAR
        teacher pass (`accelerator.autocast()`) all follow it.
    asked: what the config said ("auto", "true", "false").
    device: "cpu" or "cuda". capability: the CPU's `get_cpu_capability()` or the GPU's name.
    reason: one sentence, printed at the start of a run and kept in config.yaml.
    """

    bf16: bool
    asked: str
    device: str
    capability: str
    reason: str

    @property
    def name(self) -> str:
        return "bf16 autocast" if self.bf16 else "float32"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"evaluation": "float32"}


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags (x86 "flags", ARM "Features") or None where the file is absent."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def cpu_capability() -> str:
    """`torch.backends.cpu.get_cpu_capability()`: "AVX2", "AVX512", "DEFAULT", ..."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # very old torch: no such function
        return "unknown"


def native_cpu_bf16(flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether this CPU runs bf16 natively, and the evidence (a short phrase).

    flags: the CPU flags (default: read from /proc/cpuinfo); None where they cannot be read.
    """
    flags = cpu_flags() if flags is None else flags
    if flags is not None:
        found = [f for f in NATIVE_CPU_BF16_FLAGS if f in flags]
        if found:
            return True, f"the CPU has {'/'.join(found)}"
        return False, "the CPU has no avx512_bf16/amx_bf16 (bf16 would be emulated, ~4x slower)"
    import torch

    try:
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        ok = False
    return ok, f"no /proc/cpuinfo; oneDNN reports bf16 {'supported' if ok else 'unsupported'}"


def _asked(setting: bool | str | None) -> str:
    if setting is None or (isinstance(setting, str) and setting.lower() == "auto"):
        return "auto"
    if isinstance(setting, bool):
        return str(setting).lower()
    raise ValueError(f"bf16: got {setting!r}; expected true, false or auto")


def choose_precision(
    setting: bool | str | None = "auto",
    *,
    use_cpu: bool | None = None,
    flags: set[str] | None = None,
) -> Precision:
    """Resolve a `bf16` setting (True, False, "auto"; None means "auto") for this machine.

    use_cpu: train on the CPU even where CUDA is available (TRL's `use_cpu`); default: CPU
        exactly when CUDA is unavailable. flags: CPU flags for tests (default /proc/cpuinfo).
    """
    import torch

    asked = _asked(setting)
    on_cuda = torch.cuda.is_available() and not use_cpu
    if on_cuda:
        device, capability = "cuda", torch.cuda.get_device_name()
        native = bool(torch.cuda.is_bf16_supported())
        evidence = f"the GPU {'supports' if native else 'does not support'} bf16"
    else:
        device, capability = "cpu", cpu_capability()
        native, evidence = native_cpu_bf16(flags)
    if asked == "auto":
        bf16 = native
        reason = f"bf16: auto -> {'bf16 autocast' if bf16 else 'float32'}: {evidence}"
    else:
        bf16 = asked == "true"
        reason = f"bf16: {asked} (set in the config); {evidence}"
        if bf16 and not native:
            reason += "; expect a much slower run than with bf16: auto"
    return Precision(bf16=bf16, asked=asked, device=device, capability=capability, reason=reason)
