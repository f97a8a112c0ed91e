"""Type stub of the C extension built from runtime/cpu_kernels/csrc/ (see module.c)."""

def linear(
    nthreads: int,
    weights: int,
    nweights: int,
    x: int,
    ldx: int,
    m: int,
    k: int,
    out: int,
    ldo: int,
    flags: int,
    swiglu: int,
    /,
) -> None: ...
def rms_norm(
    x: int,
    ldx: int,
    rows: int,
    out: int,
    ldo: int,
    weight: int,
    weight_dtype: int,
    n: int,
    e: int,
    eps: float,
    round: int,
    /,
) -> None: ...
def rope(
    x: int, ldx: int, heads: int, d: int, positions: int, n: int, cos: int, sin: int, round: int, /
) -> None: ...
def kv_write(
    k: int,
    v: int,
    ld: int,
    kv: int,
    kv_dtype: int,
    block_stride: int,
    block_size: int,
    row: int,
    slots: int,
    n: int,
    /,
) -> None: ...
def paged_decode_attention(
    nthreads: int,
    q: int,
    ldq: int,
    kv: int,
    kv_dtype: int,
    block_stride: int,
    block_size: int,
    heads: int,
    kv_heads: int,
    d: int,
    tables: int,
    width: int,
    rows: int,
    ctx: int,
    n: int,
    out: int,
    ldo: int,
    scale: float,
    round: int,
    /,
) -> None: ...
def embedding(weight: int, ids: int, n: int, e: int, out: int, ldo: int, /) -> None: ...
def isa() -> str: ...
def set_isa(name: str, /) -> None: ...
