"""radixserve's own CPU kernels (C++): weight-only quantized GEMM for any number of input rows,
paged decode and prefill attention that read K/V from the block pool in place, and a decoder
layer's fused elementwise steps.

Built on first use with torch's extension builder (a C++ compiler and ninja) into
`<cache root>/kernels/`, marked whole, then loaded from there as a library in later processes
(25 ms; through the builder: 0.14 s). Where they cannot be built, callers fall back to plain
torch code that computes the same thing.
The C++ is one file per concern (gemm.cpp, attention.cpp, layers.cpp over shared headers), the
kernels compiled as one unit: cpu_kernels.cpp, whose opening comment maps the files. The
weights `decode_layers` takes are named in one C++ table (layer_weights.h, layer_weights.cpp):
Python lists each layer's weights by those names (`order_layer_weights`).

Environment:
  RADIXSERVE_CPU_KERNELS=0     do not build or use the kernels (the torch fallbacks run).
  RADIXSERVE_CPU_ISA           the widest instruction set to build for, never wider than the
                               CPU's: avx512 (the default), avx2 (AVX2 + FMA + F16C: what an
                               AVX2-only CPU such as AMD Zen 3 runs, built and tested on an
                               AVX-512 one) or portable (no vector flags: the plain C++ paths).
                               Each flag set builds into its own directory.
  RADIXSERVE_KERNEL_CACHE_DIR  where builds live (default ~/.cache/radixserve/kernels).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from radixserve.model.locks import file_lock

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# The extension's translation units: the kernels (cpu_kernels.cpp includes gemm.cpp,
# attention.cpp and layers.cpp), the table of decode_layers' weights and the CPU allocator.
_SOURCES = [_DIR / "cpu_kernels.cpp", _DIR / "layer_weights.cpp", _DIR / "buffer_cache.cpp"]
_ISAS = ("avx512", "avx2", "portable")  # RADIXSERVE_CPU_ISA's values, widest first
_BUILT = "built"  # written into a build directory once its library is built and loaded whole
_loaded: bool | None = None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def has_amx() -> bool:
    """Whether the CPU has AMX's bfloat16 tiles in hardware (whether Linux grants them or not)."""
    return {"amx_tile", "amx_bf16"} <= _cpu_flags()


def kernel_cache_dir() -> Path:
    """Where built kernels live: $RADIXSERVE_KERNEL_CACHE_DIR or ~/.cache/radixserve/kernels
    (apart from the model cache, so a fresh model cache does not rebuild them)."""
    env = os.environ.get("RADIXSERVE_KERNEL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "radixserve" / "kernels"


def _isa_cap() -> str:
    """The widest instruction set $RADIXSERVE_CPU_ISA allows (all of them when unset)."""
    isa = os.environ.get("RADIXSERVE_CPU_ISA", "avx512").strip().lower() or "avx512"
    if isa not in _ISAS:
        log.warning("RADIXSERVE_CPU_ISA=%s is not one of %s; ignored", isa, ", ".join(_ISAS))
        return "avx512"
    return isa


def compile_flags() -> list[str]:
    """Compiler flags for this CPU: AVX2 + FMA + F16C code where the CPU has them, AVX-512
    (F, BW, VL, DQ) for the decode step's hot loops where it has those too, and AVX-512 BF16
    and AMX for the prefill paths (kernels/matrix.py) where it has those; never wider than
    $RADIXSERVE_CPU_ISA allows."""
    # -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without the flag
    # the kernels silently run on one thread. The libgomp torch already loaded is reused.
    flags = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
    allowed = _ISAS[_ISAS.index(_isa_cap()) :]
    cpu = _cpu_flags()
    x86 = platform.machine() in ("x86_64", "AMD64")
    if x86 and "avx2" in allowed and {"avx2", "fma", "f16c"} <= cpu:
        flags += ["-mavx2", "-mfma", "-mf16c"]
        if "avx512" in allowed and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu:
            flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
            if "avx512_vnni" in cpu:  # int8 activations (gemm_vnni.cpp)
                flags += ["-mavx512vnni"]
            # The bfloat16 matrix units (gemm_bf16.cpp): only explicit intrinsics use them.
            if "avx512_bf16" in cpu:
                flags += ["-mavx512bf16"]
                if {"amx_tile", "amx_bf16"} <= cpu:
                    flags += ["-mamx-tile", "-mamx-bf16"]
    return flags


def _build_key(flags: list[str]) -> str:
    """A hash of every C++ source and header here, their directory, torch's version and the
    flags: a change to any of them builds anew, into its own directory. (The build files
    name the sources by path: two checkouts sharing one directory would each rebuild it.)"""
    digest = hashlib.sha1(f"{torch.__version__}{flags}{_DIR.resolve()}".encode())
    for path in sorted([*_DIR.glob("*.cpp"), *_DIR.glob("*.h")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def load() -> bool:
    """Build (once) and load the kernels; False, with a warning, where that is impossible.

    RADIXSERVE_CPU_KERNELS=0 turns them off (the torch fallbacks are then used).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        return False
    flags = compile_flags()
    key = _build_key(flags)
    build_dir = kernel_cache_dir() / f"cpu-{key}"
    name = f"radixserve_cpu_{key}"
    library, built = build_dir / f"{name}.so", build_dir / _BUILT  # the library torch builds
    try:
        log.info("loading radixserve CPU kernels from %s (built on first use)", build_dir)
        if built.exists() and library.exists():
            # Built whole by an earlier process (the key names every source and flag): what
            # torch's builder would load after finding nothing to do, without importing it and
            # setuptools and running ninja (0.14 s of every start).
            torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
        else:
            _build(build_dir, name, flags)
    except Exception as e:  # no compiler, no ninja, an unusual platform: run without them
        log.warning("radixserve's CPU kernels are unavailable (%s); using torch fallbacks", e)
        return False
    _set_iq_grids()
    _loaded = True
    return True


def _build(build_dir: Path, name: str, flags: list[str]) -> None:
    """Build the kernels as library `name` into `build_dir` with torch's extension builder
    (nothing to do when an earlier build is current) and load them; then mark the build whole
    (`_BUILT`)."""
    from torch.utils.cpp_extension import load as build

    build_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(build_dir / "radixserve.lock", "waiting for another process's build"):
        _drop_stale_baton(build_dir)
        (build_dir / _BUILT).unlink(missing_ok=True)  # a link cut short is not whole
        build(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            build_directory=str(build_dir),
        )
        (build_dir / _BUILT).touch()


def _set_iq_grids() -> None:
    """Hand the kernels the gguf package's grids of the 2- and 3-bit i-quants (IQ2_XXS, IQ2_XS,
    IQ2_S, IQ3_XXS, IQ3_S: kquants.cpp's IqGrids), as bytes. Without gguf (which every GGUF
    load needs) nothing is set: the kernels refuse those types."""
    try:
        from gguf import quants
    except ImportError:
        return

    grids = []
    for cls in (quants.IQ2_XXS, quants.IQ2_XS, quants.IQ2_S, quants.IQ3_XXS, quants.IQ3_S):
        cls.init_grid()  # type: ignore[no-untyped-call]
        assert cls.grid is not None
        grids.append(torch.from_numpy(cls.grid.reshape(-1).astype("uint8")))
    op("set_iq_grids")(*grids)


def _drop_stale_baton(build_dir: Path) -> None:
    """Delete torch's build baton (`lock`, a plain file it creates and deletes around a build)
    left by a builder killed mid-build, which would make every later load wait forever. Call
    holding the directory's file_lock: every radixserve builder takes that first, and the
    kernel dropped it when the killed one died, so no live build holds the baton."""
    baton = build_dir / "lock"
    if baton.exists():
        log.warning("%s: removing the lock a killed build left behind", build_dir)
        baton.unlink(missing_ok=True)


@functools.cache
def op(name: str) -> Callable[..., Any]:
    """Our kernel `name` (e.g. "q4_gemm"), looked up once: a torch.ops attribute lookup costs
    about a microsecond, and a decode step calls our kernels hundreds of times."""
    found: Callable[..., Any] = getattr(torch.ops.radixserve, name).default
    return found


def release_thread_pool() -> None:
    """Free the calling thread's idle OpenMP workers (where our kernels are loaded).

    Call it in a thread that has done its share of device work (loading the model) before
    another thread takes the work over: with more OpenMP threads alive than CPUs, libgomp's
    workers barely spin before sleeping, and each parallel region of the working thread then
    waits on waking its workers (a decode step 2.5-3x slower on 2 cores)."""
    if loaded():
        op("release_omp_threads")()


# Bytes of freed large buffers the CPU allocator keeps for reuse: a 512-token prefill step's
# temporaries on an 8B model (its FFN activations alone: 88 MiB) fit, and more is unmapped.
STEP_BUFFER_BYTES = 256 << 20


def keep_step_buffers(limit_bytes: int = STEP_BUFFER_BYTES) -> bool:
    """Make torch's CPU allocator buffer_cache.cpp's, keeping up to `limit_bytes` of freed
    buffers of 1 MiB and more for the next step to reuse (where our kernels can be loaded;
    False otherwise). Tensors allocated before keep their allocator."""
    if not load():
        return False
    op("use_buffer_cache")(limit_bytes)
    return True


def step_buffer_stats() -> dict[str, int]:
    """The CPU allocator's buffers of 1 MiB and more (zeros before `keep_step_buffers`)."""
    if not loaded():
        return {"kept_bytes": 0, "mapped_bytes": 0, "reused": 0, "mapped": 0}
    kept, mapped_bytes, reused, mapped = op("buffer_cache_stats")()
    return {"kept_bytes": kept, "mapped_bytes": mapped_bytes, "reused": reused, "mapped": mapped}


@contextlib.contextmanager
def exact_rows() -> Iterator[None]:
    """Within this block (on the calling thread's steps), the 2-16-row GEMMs compute each input
    row with the one-row GEMV's own arithmetic, so a row's result is bit for bit what it would
    be alone: the model runner's steps that verify speculative drafts. Otherwise the faster
    many-row arithmetic runs, whose sums are ordered differently."""
    if not loaded():
        yield
        return
    op("set_exact_rows")(True)
    try:
        yield
    finally:
        op("set_exact_rows")(False)


class LayerWeightsError(ValueError):
    """A layer's named weights do not match the names `decode_layers` takes."""


@functools.cache
def decode_layer_weight_names() -> tuple[str, ...]:
    """The names of one decoder layer's weights in the order `decode_layers` takes them, from
    the kernels' table (layer_weights.cpp; load() must have succeeded)."""
    names: list[str] = op("decode_layer_weight_names")()
    return tuple(names)


def order_layer_weights(layers: Iterable[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
    """The `weights` argument of `decode_layers`: each layer's tensors, given by name, in the
    kernels' order. LayerWeightsError, naming the weights, where a layer lacks one the kernel
    takes or has one it does not."""
    names = decode_layer_weight_names()
    ordered: list[torch.Tensor] = []
    for i, named in enumerate(layers):
        missing = [f"{n!r} (slot {slot})" for slot, n in enumerate(names) if n not in named]
        unknown = [repr(n) for n in named if n not in names]
        if missing or unknown:
            problems = [f"missing {', '.join(missing)}"] if missing else []
            problems += [f"not in the table: {', '.join(unknown)}"] if unknown else []
            raise LayerWeightsError(
                f"layer {i}'s weights do not match decode_layers' table (layer_weights.cpp): "
                + "; ".join(problems)
            )
        ordered += [named[n] for n in names]
    return ordered


@functools.cache
def quant_kind_code(kind: str) -> int:
    """The kernels' number for QuantizedWeight kind `kind` ("int4", "q4_k", ...; GGUF block
    kinds by their GGML type number, quant_kinds.h); -1 for a kind they do not compute.
    load() must have succeeded."""
    code: int = op("quant_kind_code")(kind)
    return code


def decode_layers_computes(kind: str) -> bool:
    """Whether `decode_layers` runs projections holding `kind` codes (False without the
    kernels; "gguf" weights hold only kinds the kernels compute)."""
    return loaded() and (kind == "gguf" or quant_kind_code(kind) >= 0)


def loaded() -> bool:
    """Whether load() succeeded (without trying to build)."""
    return bool(_loaded)
