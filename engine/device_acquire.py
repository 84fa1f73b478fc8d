"""The acquire of a decode step as a kernel on MLX CUDA's own stream.

On a GPU an MoE layer's expert ids exist only on the device. The CPU-stream `acquire_op`
makes MLX hand them across streams (the GPU signals an event a CPU thread waits for,
then waits for that thread's signal): two graph commits and two thread wake-ups per MoE
layer, hit or miss. Here a kernel on the GPU's stream writes the ids (and, for a
prefetch source, the hidden state of each row's last token: a batch's decode step has a
row per reply) into the cache's `AcquireMailbox` in mapped host memory and spins until the
mailbox's thread has answered with their pool rows; the thread runs the same
`ExpertCache.acquire` (hits, side hits, demand reads) and then the prefetch the hidden
states predict (ext/mailbox.h). A layer whose experts all have real slots does not wait
for the thread at all: the kernel takes their rows from the cache's hit table (mapped
host memory the host keeps) and posts the request for the thread to count later; the
next request's kernel waits for that answer, by which time the device has computed the
layer.

Neither that thread nor a reader thread may make a CUDA call that waits for the device
while a kernel spins (a pool write waits for its copy, which can queue behind the
spinning kernel), so the cache stages its pool writes
in mapped host memory (ext/staged_copies.h) and each answer delivers them: a copy kernel
of many blocks copies the records (demand reads and prefetch fills) and the side-row
promotions, all at once, before the rows reach the experts' kernels; only where a copy of
the answer writes what a promotion reads or writes does the acquire kernel make the
promotions first, one after another.

With `fill_stream` (`StreamConfig.fill_stream`), prefetch fills need not wait for that
copy kernel, which runs on the compute stream ahead of the experts: the mailbox's thread
queues them on a CUDA stream of their own, where the device's copy engines copy them
while the compute stream runs; a batch's side rows are handed out again once its copies
have landed (which rows a batch may write, and why no kernel waits for it:
ext/mailbox.h).

CUDA only: `mx.fast.cuda_kernel` compiles the kernels at first use. Metal keeps the
CPU-stream path (no Metal kernel of this kind has been run).
"""

import mlx.core as mx

from engine._ext import AcquireMailbox, Router

# The longest a kernel waits for the mailbox's thread before it traps (a CUDA error the
# next evaluation raises): only a thread that died leaves a request unanswered, since an
# acquire that fails still answers, with rows 0 and an error for the host.
ANSWER_TIMEOUT_S = 600

_BLOCK = 256
# Blocks of the copy kernel. Every block reads every record's header from mapped host
# memory and walks every record for its chunks, so each block added costs reads over the
# bus as well as copy bandwidth: the count is the fastest one measured (docs/benchmarks.md,
# "Decode on a GPU"). A kernel with nothing to copy exits at once.
_COPY_BLOCKS = 16

# The mailbox's addresses come in as the kernels' first input, `box` (uint64 [words,
# copies, hit table, experts, x rows]), not as literals: the source is then
# the same for every cache, and MLX compiles each kernel once per process (its JIT modules
# are keyed by name and source).
_HEADER = """
#define ES_WORD(i) (reinterpret_cast<volatile int*>(es_words)[(i)])
#define ES_COPY(i, f) (reinterpret_cast<volatile unsigned long long*>(es_copies)[4 * (i) + (f)])
#define ES_HIT(i) (reinterpret_cast<volatile int*>(es_hits)[(i)])
__device__ __forceinline__ unsigned long long es_now() {{
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}}
// Copies [begin, end) of `bytes` from src to dst with threads t of nt, in the widest
// words the addresses allow. Loads bypass the caches (__ldcv): the host rewrites a
// staging slot between kernels that read it.
__device__ void es_copy(unsigned long long src, unsigned long long dst,
                        unsigned long long begin, unsigned long long end, int t, int nt) {{
  if (((src | dst | begin | end) & 15ULL) == 0) {{
    // Four loads in flight per thread: reads of host memory take microseconds each.
    const uint4* s = reinterpret_cast<const uint4*>(src + begin);
    uint4* d = reinterpret_cast<uint4*>(dst + begin);
    const unsigned long long n = (end - begin) / 16;
    unsigned long long i = t;
    for (; i + 3 * nt < n; i += 4 * nt) {{
      const uint4 a = __ldcv(s + i), b = __ldcv(s + i + nt);
      const uint4 c = __ldcv(s + i + 2 * nt), e = __ldcv(s + i + 3 * nt);
      d[i] = a;
      d[i + nt] = b;
      d[i + 2 * nt] = c;
      d[i + 3 * nt] = e;
    }}
    for (; i < n; i += nt) d[i] = __ldcv(s + i);
  }} else if (((src | dst | begin | end) & 3ULL) == 0) {{
    const unsigned int* s = reinterpret_cast<const unsigned int*>(src + begin);
    unsigned int* d = reinterpret_cast<unsigned int*>(dst + begin);
    for (unsigned long long i = t; i < (end - begin) / 4; i += nt) d[i] = __ldcv(s + i);
  }} else {{
    const volatile unsigned char* s = reinterpret_cast<const volatile unsigned char*>(src);
    unsigned char* d = reinterpret_cast<unsigned char*>(dst);
    for (unsigned long long i = begin + t; i < end; i += nt) d[i] = s[i];
  }}
}}
__device__ void es_wait_reply(unsigned long long es_words, int seq) {{
  const unsigned long long start = es_now();
  while (ES_WORD({reply}) != seq) {{
    __nanosleep(128);
    if (es_now() - start > {timeout_ns}ULL) __trap();
  }}
  __threadfence_system();
}}
// Copies records [first, first + records) of the StagedCopy entries at es_copies, cut
// into chunks dealt round-robin to the blocks. Record headers go through shared memory
// {block} at a time (one read of mapped memory per thread).
__device__ void es_copy_records(unsigned long long es_copies, int first, int records, int tid) {{
  __shared__ unsigned long long src[{block}], dst[{block}], bytes[{block}], chunk0[{block}];
  for (int batch = 0; batch < records; batch += {block}) {{
    const int m = min({block}, records - batch);
    if (tid < m) {{
      src[tid] = ES_COPY(first + batch + tid, 0);
      dst[tid] = ES_COPY(first + batch + tid, 1);
      bytes[tid] = ES_COPY(first + batch + tid, 2);
      chunk0[tid] = ES_COPY(first + batch + tid, 3);
    }}
    __syncthreads();
    for (int r = 0; r < m; ++r) {{
      const unsigned long long chunks = (bytes[r] + {chunk} - 1) / {chunk};
      unsigned long long k = (blockIdx.x + gridDim.x - chunk0[r] % gridDim.x) % gridDim.x;
      for (; k < chunks; k += gridDim.x) {{
        const unsigned long long begin = k * {chunk};
        const unsigned long long end = min(bytes[r], begin + {chunk});
        es_copy(src[r], dst[r], begin, end, tid, blockDim.x);
      }}
    }}
    __syncthreads();
  }}
}}
"""

# One block: thread 0 waits for the previous request's answer (normally already there),
# every thread writes its share of the ids and hidden state and looks its ids up in the
# hit table, and after a system fence thread 0 publishes the sequence number and, for an
# acquire with an id the table lacks, waits for the rows. `es_fast` stays 1 only where
# every id has an entry (threads only ever write 0 to it).
_POST = """
  const unsigned long long es_words = box[0];
  const unsigned long long es_copies = box[1];
  const unsigned long long es_hits = box[2];
  const int es_experts = static_cast<int>(box[3]);
  __shared__ int seq;
  __shared__ int es_fast;
  __shared__ int es_rows[{max_ids}];
  int es_x_rows = 0;
  const int tid = threadIdx.x;
  if (tid == 0) {{
    const int previous = ES_WORD({request});
    es_wait_reply(es_words, previous);
    seq = previous + 1;
    es_fast = {lookup};
  }}
  __syncthreads();
  __threadfence_system();
  {copy_ids}
  {copy_x}
  __syncthreads();
  if (tid == 0) {{
    ES_WORD({layer_word}) = layer[0];
    ES_WORD({count}) = {n};
    ES_WORD({x_rows_word}) = es_x_rows;
    ES_WORD({fast_word}) = es_fast;
  }}
  __threadfence_system();
  __syncthreads();
  if (tid == 0) {{
    ES_WORD({request}) = seq;
    __threadfence_system();
    if (!es_fast) {{
      {wait}
    }}
  }}
  __syncthreads();
  {out}
"""

_COPY_IDS = """
  int n = 1;
  for (int d = 0; d < ids_ndim; ++d) n *= ids_shape[d];
  for (int i = tid; i < n; i += blockDim.x) {{
    long long off = 0;
    int rest = i;
    for (int d = ids_ndim - 1; d >= 0; --d) {{
      off += (long long)(rest % ids_shape[d]) * ids_strides[d];
      rest /= ids_shape[d];
    }}
    const int id = static_cast<int>(ids[off]);
    ES_WORD({ids_word} + i) = id;
    const int row = id >= 0 && id < es_experts ? ES_HIT(layer[0] * es_experts + id) : -1;
    if (row < 0) es_fast = 0;
    else es_rows[i] = row;
  }}
"""

# The hidden states of x's last `es_x_rows` tokens (at most the mailbox's x_rows, box[4]):
# a decode step's rows, one token each.
_COPY_X = """
  {{
    const int h = x_shape[x_ndim - 1];
    int tokens = 1;
    for (int d = 0; d + 1 < x_ndim; ++d) tokens *= x_shape[d];
    es_x_rows = min(tokens, static_cast<int>(box[4]));
    volatile float* hx = reinterpret_cast<volatile float*>(&ES_WORD({hidden_word}));
    for (int i = tid; i < es_x_rows * h; i += blockDim.x) {{
      const int j = i % h;
      int rest = tokens - es_x_rows + i / h;
      long long off = (long long)j * x_strides[x_ndim - 1];
      for (int d = x_ndim - 2; d >= 0; --d) {{
        off += (long long)(rest % x_shape[d]) * x_strides[d];
        rest /= x_shape[d];
      }}
      hx[i] = static_cast<float>(x[off]);
    }}
  }}
"""

# After the answer: the row copies it orders, one at a time (a later one may read an
# earlier's target), then the head the copy kernel reads: [row copies, record copies,
# chunks, rows].
# Rows from the hit table come with no copies.
_HEAD_OUT = """
  if (es_fast) {{
    if (tid == 0) head[0] = head[1] = head[2] = 0;
    for (int i = tid; i < n; i += blockDim.x) head[3 + i] = es_rows[i];
  }} else {{
    const int row_copies = ES_WORD({row_copies});
    for (int c = 0; c < row_copies; ++c) {{
      es_copy(ES_COPY(c, 0), ES_COPY(c, 1), 0, ES_COPY(c, 2), tid, blockDim.x);
      __syncthreads();
    }}
    if (tid == 0) {{
      head[0] = row_copies;
      head[1] = ES_WORD({record_copies});
      head[2] = ES_WORD({chunks});
    }}
    for (int i = tid; i < n; i += blockDim.x) head[3 + i] = ES_WORD({rows_word} + i);
  }}
"""

# The record copies of the answer whose head it reads; block 0 also writes the rows out.
_COPY = """
  const unsigned long long es_copies = box[1];
  const int tid = threadIdx.x;
  const int n = head_shape[0] - 3;
  if (blockIdx.x == 0)
    for (int i = tid; i < n; i += blockDim.x) rows[i] = head[3 + i];
  es_copy_records(es_copies, head[0], head[1], tid);
"""


class DeviceAcquire:
    """Acquire, copy and prefetch kernels of one cache on MLX CUDA's default stream.

    Args:
        cache: the model's `engine._ext.ExpertCache` (pools in CUDA memory); its pool
            writes are staged from the first acquire on (`ExpertCache.set_staging`).
        hidden: the hidden size of the MoE layers' input (the prefetch's x).
        max_ids: the most ids of one acquire (`AcquireMailbox.max_ids`).
        fill_slots: staging slots for prefetch fills.
        tier_slots: host-tier slots per MoE layer (`AcquireMailbox`; 0: no tier).
        fill_stream: prefetch fills copied by the device's copy engines on a stream of
            their own, beside the compute (`StreamConfig.fill_stream`); False: by the next
            answer's copy kernel.
        x_rows: the most rows of x a prediction reads (a decode step's replies): the
            last `x_rows` tokens of a longer x.

    Raises:
        RuntimeError: the CUDA runtime refused to map the mailbox's memory.
    """

    def __init__(
        self,
        cache,
        hidden: int,
        max_ids: int,
        fill_slots: int,
        tier_slots: int = 0,
        fill_stream: bool = False,
        x_rows: int = 1,
    ):
        # Every stream a kernel was queued on (mlx-lm generates on a stream of its own,
        # not the default one), so that each can be waited for; first, for __del__.
        self._streams: list[mx.Stream] = []
        self.mailbox = AcquireMailbox(cache, hidden, max_ids, fill_slots, tier_slots, x_rows)
        self.hidden = hidden
        self.max_ids = max_ids
        layout = AcquireMailbox
        self._box = mx.array(
            [
                self.mailbox.address,
                self.mailbox.copies_address,
                self.mailbox.hit_table_address,
                cache.num_experts,
                x_rows,
            ],
            mx.uint64,
        )
        words = {
            "reply": layout.REPLY,
            "request": layout.REQUEST,
            "layer_word": layout.LAYER,
            "count": layout.COUNT,
            "x_rows_word": layout.X_ROWS,
            "row_copies": layout.ROW_COPIES,
            "record_copies": layout.RECORD_COPIES,
            "chunks": layout.CHUNKS,
            "fast_word": layout.FAST,
            "max_ids": layout.MAX_IDS,
            "ids_word": layout.IDS,
            "rows_word": layout.ROWS,
            "hidden_word": layout.HIDDEN,
            "timeout_ns": ANSWER_TIMEOUT_S * 10**9,
            "block": _BLOCK,
            "chunk": f"{layout.CHUNK_BYTES}ULL",
        }
        header = _HEADER.format(**words)
        self._kernels = {}
        for variant, inputs in (
            ("acquire", ["box", "ids", "layer"]),
            ("acquire_x", ["box", "ids", "layer", "x"]),
            ("prefetch", ["box", "layer", "x"]),
        ):
            with_ids = variant != "prefetch"
            with_x = variant != "acquire"
            source = _POST.format(
                copy_ids=_COPY_IDS.format(**words) if with_ids else "",
                copy_x=_COPY_X.format(**words) if with_x else "",
                n="n" if with_ids else 0,
                lookup=int(with_ids),
                wait="es_wait_reply(es_words, seq);" if with_ids else "",
                out=_HEAD_OUT.format(**words) if with_ids else "if (tid == 0) head[0] = 0;",
                **words,
            )
            self._kernels[variant] = mx.fast.cuda_kernel(
                name=f"expert_acquire_{variant}",
                input_names=inputs,
                output_names=["head"],
                source=source,
                header=header,
                ensure_row_contiguous=False,
            )
        self._copy = mx.fast.cuda_kernel(
            name="expert_acquire_copy",
            input_names=["box", "head"],
            output_names=["rows"],
            source=_COPY.format(**words),
            header=header,
        )
        # Set on the mailbox when staging starts (`_stage`), so that its CUDA stream is
        # made after MLX's own.
        self._fill_stream = fill_stream
        self._layers: dict[int, mx.array] = {}
        self._plans: dict[int, tuple] = {}
        self._cache = cache

    def __del__(self):
        # A forward still queued posts to the mailbox: let it finish while the mailbox's
        # thread still answers (its memory goes with it).
        self.synchronize()

    def synchronize(self) -> None:
        """Waits until every kernel queued so far has run, on whichever stream."""
        for stream in self._streams:
            mx.synchronize(stream)

    @property
    def fill_stream(self) -> bool:
        """Whether prefetch fills are copied on the fill stream beside the compute (the
        constructor's `fill_stream`); set False, the batches in flight still land, and
        fills go with the answers' copies until set True."""
        return self._fill_stream

    @fill_stream.setter
    def fill_stream(self, on: bool) -> None:
        self._fill_stream = bool(on)
        self.mailbox.fill_stream = self._fill_stream

    def _stage(self):
        """Staged pool writes from here on, on the current stream. The graph is built
        while an earlier one may still run: one that took a host path (writes not
        staged) ends first."""
        stream = mx.default_stream(mx.default_device())
        if stream not in self._streams:  # a new object per call: compared by value
            self._streams.append(stream)
        if not self._cache.staging_on:
            self.synchronize()
            self._cache.set_staging(True)
            self.mailbox.fill_stream = self._fill_stream

    def _layer(self, layer: int) -> mx.array:
        arr = self._layers.get(layer)
        if arr is None:
            arr = self._layers[layer] = mx.array([layer], mx.int32)
        return arr

    def rows(self, layer: int, ids: mx.array, x: mx.array | None = None) -> mx.array:
        """Lazy int32 pool rows of `ids` (any integer dtype, shape and strides, at most
        `max_ids` of them) for MoE layer `layer`, the answer's pool copies done before
        them; with `x` ((..., hidden), any float dtype), the mailbox's thread then
        prefetches what x's last tokens (up to `x_rows`: a decode step's rows) predict for the
        layer's targets (`set_prefetch`)."""
        self._stage()
        variant = "acquire" if x is None else "acquire_x"
        inputs = [self._box, ids, self._layer(layer)] + ([] if x is None else [x])
        (head,) = self._kernels[variant](
            inputs=inputs,
            output_shapes=[(ids.size + 3,)],
            output_dtypes=[mx.int32],
            grid=(_BLOCK, 1, 1),
            threadgroup=(_BLOCK, 1, 1),
        )
        (rows,) = self._copy(
            inputs=[self._box, head],
            output_shapes=[ids.shape],
            output_dtypes=[mx.int32],
            grid=(_BLOCK * _COPY_BLOCKS, 1, 1),
            threadgroup=(_BLOCK, 1, 1),
        )
        return rows

    def prefetch(self, layer: int, x: mx.array) -> mx.array:
        """A lazy int32 (1,) array that, evaluated, hands x's last tokens to the mailbox's
        thread for the layer's prefetch without waiting for it (a layer that takes the
        table path, whose targets still miss)."""
        self._stage()
        (token,) = self._kernels["prefetch"](
            inputs=[self._box, self._layer(layer), x],
            output_shapes=[(1,)],
            output_dtypes=[mx.int32],
            grid=(_BLOCK, 1, 1),
            threadgroup=(_BLOCK, 1, 1),
        )
        return token

    def set_prefetch(self, layer: int, targets: list[int], routers: list[Router], budget: int):
        """What the mailbox's thread prefetches after a request of `layer` that carries a
        hidden state (`AcquireMailbox.set_prefetch`); a plan equal to the last one given
        for the layer is not sent again."""
        plan = (tuple(targets), tuple(id(r) for r in routers), budget)
        if self._plans.get(layer) != plan:
            self.mailbox.set_prefetch(layer, targets, routers, budget)
            self._plans[layer] = plan
