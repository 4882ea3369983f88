"""Worker configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.batching import DEFAULT, field_help
from canteen.config import option, parse_bytes, require
from canteen.metrics import METRICS_PORT_HELP
from canteen.models import DEFAULT_MODEL_NAME
from canteen.tls import InternalLinkOptions
from canteen.tracing import OTLP_ENDPOINT_HELP
from worker.graphs import GraphSizes
from worker.speculate import SPECULATIVE_KINDS


@dataclass(frozen=True)
class WorkerConfig(InternalLinkOptions):
    """Flags and CANTEEN_* variables of ``python -m worker``."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(50061, "gRPC port")
    metrics_port: int = option(-1, METRICS_PORT_HELP)
    otlp_endpoint: str = option("", OTLP_ENDPOINT_HELP)
    advertise_host: str = option("", "host the scheduler dials (default: --host)")
    registry: str = option("127.0.0.1:50053", "registry address")
    model: str = option(DEFAULT_MODEL_NAME, "model to serve, NAME or NAME:VERSION")
    device: str = option("auto", "cpu, cuda, cuda:N or auto (CUDA when present)")
    dtype: str = option(
        "auto",
        "float32, bfloat16, float16 or auto (bfloat16 on CPUs with AMX or AVX512-BF16 and on "
        "GPUs that have it, float16 on older GPUs, float32 elsewhere)",
    )
    quantization: str = option(
        "none",
        "weight-only quantization at load: none, int8 (per row) or int4 (groups of 32; a GGUF's "
        "Q4_1 values are carried exactly); CPU only, computes in bfloat16",
    )
    forward: str = option(
        "fast",
        "fast (Canteen's fused layers, for llama, mistral, qwen2, qwen3, granite) or "
        "transformers (the reference forward; always used for other families)",
    )
    speculative: str = option(
        "none",
        "speculative decoding: none, or ngram (draft tokens looked up in the sequence's own "
        "prompt and output, verified in the same forward; the tokens are exactly those "
        "without it)",
    )
    num_speculative_tokens: int = option(4, "most draft tokens per sequence and step, 1..16")
    draft_model: str = option(
        "",
        "with --speculative draft: the registry model (NAME or NAME:VERSION) that proposes "
        "drafts; it must share the served model's tokenizer (the same model with "
        "--draft-quantization int4 is a natural one)",
    )
    draft_quantization: str = option("none", "the draft model's --quantization: none, int8, int4")
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: str = option("512MiB", "bytes of KV cache, e.g. 512MiB or 2GiB")
    memory_fraction: float = option(
        0.0,
        "share of device memory (CUDA) or available RAM (CPU) the worker may hold; the KV pool "
        "gets what the weights and warm-up leave (overrides --kv-cache-memory; 0: off)",
    )
    num_kv_blocks: int = option(0, "exact number of KV blocks (overrides both above)")
    max_batched_tokens: int = option(DEFAULT.max_batched_tokens, field_help("max_batched_tokens"))
    cuda_graph_max_batch: int = option(
        32,
        "on CUDA with --forward fast, decode steps of up to this many sequences replay "
        "captured CUDA graphs (one launch instead of hundreds); 0: off",
    )
    cuda_graph_max_context: int = option(
        2048, "the longest context (tokens) a graphed decode step attends over"
    )
    threads: int = option(0, "torch CPU threads (0: torch's default)")
    worker_id: str = option("", "worker id (default: generated)")
    grace: float = option(30.0, "seconds running sequences get to finish on SIGTERM")
    verify_checksum: bool = option(True, "check the weights' sha256 against the registry")

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "port", self.port, "must be in 0..65535")
        require(
            -1 <= self.metrics_port <= 65535,
            "metrics_port",
            self.metrics_port,
            "must be in 0..65535, or -1 for off",
        )
        require(
            self.block_size in (8, 16, 32, 64, 128),
            "block_size",
            self.block_size,
            "must be one of 8, 16, 32, 64, 128",
        )
        require(self.num_kv_blocks >= 0, "num_kv_blocks", self.num_kv_blocks, "must be >= 0")
        require(
            self.max_batched_tokens >= 16,
            "max_batched_tokens",
            self.max_batched_tokens,
            "must be >= 16",
        )
        require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "dtype",
            self.dtype,
            "must be auto, float32, bfloat16 or float16",
        )
        require(
            self.quantization in ("none", "int8", "int4"),
            "quantization",
            self.quantization,
            "must be none, int8 or int4",
        )
        require(
            self.quantization == "none" or self.dtype in ("auto", "bfloat16"),
            "dtype",
            self.dtype,
            "must be auto or bfloat16 with --quantization (the low-bit kernels compute in it)",
        )
        require(
            self.speculative in SPECULATIVE_KINDS,
            "speculative",
            self.speculative,
            "must be none, ngram or draft",
        )
        require(
            (self.speculative == "draft") == bool(self.draft_model),
            "draft_model",
            self.draft_model or "''",
            "give a draft model with --speculative draft, and only with it",
        )
        require(
            self.draft_quantization in ("none", "int8", "int4"),
            "draft_quantization",
            self.draft_quantization,
            "must be none, int8 or int4",
        )
        require(
            self.draft_quantization == "none" or self.dtype in ("auto", "bfloat16"),
            "dtype",
            self.dtype,
            "must be auto or bfloat16 with --draft-quantization (the low-bit kernels compute "
            "in it)",
        )
        require(
            1 <= self.num_speculative_tokens <= 16,
            "num_speculative_tokens",
            self.num_speculative_tokens,
            "must be in 1..16",
        )
        require(
            self.forward in ("fast", "transformers"),
            "forward",
            self.forward,
            "must be fast or transformers",
        )
        require(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "device",
            self.device,
            "must be auto, cpu, cuda or cuda:N",
        )
        require(
            0 <= self.memory_fraction <= 0.98,
            "memory_fraction",
            self.memory_fraction,
            "must be in (0, 0.98], or 0 for --kv-cache-memory",
        )
        require(
            0 <= self.cuda_graph_max_batch <= 512,
            "cuda_graph_max_batch",
            self.cuda_graph_max_batch,
            "must be in 0..512 (0: off)",
        )
        require(
            1 <= self.cuda_graph_max_context <= 131072,
            "cuda_graph_max_context",
            self.cuda_graph_max_context,
            "must be in 1..131072",
        )
        require(self.threads >= 0, "threads", self.threads, "must be >= 0")
        require(self.grace >= 0, "grace", self.grace, "must be >= 0")
        parse_bytes(self.kv_cache_memory)

    @property
    def graph_sizes(self) -> GraphSizes | None:
        if not self.cuda_graph_max_batch:
            return None
        return GraphSizes(self.cuda_graph_max_batch, self.cuda_graph_max_context)

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)
