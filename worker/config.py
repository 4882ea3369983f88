"""Worker configuration."""

from __future__ import annotations

from dataclasses import dataclass

from canteen.batching import flag
from canteen.config import (
    PORT,
    PORT_OR_OFF,
    Bound,
    at_least,
    check_bounds,
    one_of,
    option,
    parse_bytes,
    require,
    within,
)
from canteen.local_socket import LOCAL_LINK_RULE
from canteen.metrics import METRICS_PORT_HELP
from canteen.models import DEFAULT_MODEL_NAME
from canteen.tls import InternalLinkOptions
from canteen.tracing import OTLP_ENDPOINT_HELP
from worker.engine.constrain import GrammarOptions
from worker.engine.graphs import GraphSizes
from worker.engine.threads import NARROW_STEP_ROWS, SMALL_STEP_MMACS
from worker.lora.store import LoraOptions
from worker.speculation.speculate import SPECULATIVE_KINDS

_GRAMMAR = GrammarOptions()  # the grammar flags' defaults are the runner's

QUANTIZATIONS = one_of("none", "int8", "int4")
TARGET_QUANTIZATIONS = one_of("auto", "none", "int8", "int4")


@dataclass(frozen=True)
class WorkerConfig(InternalLinkOptions):
    """Flags and CANTEEN_* variables of ``python -m worker``."""

    host: str = option("127.0.0.1", "interface to bind")
    port: int = option(50061, "gRPC port", PORT)
    metrics_port: int = option(-1, METRICS_PORT_HELP, PORT_OR_OFF)
    otlp_endpoint: str = option("", OTLP_ENDPOINT_HELP)
    advertise_host: str = option("", "host the scheduler dials (default: --host)")
    local_link: str = option(
        "auto",
        "auto: also serve Run on a private Unix socket, which a scheduler on this host and "
        "user dials instead of gRPC (less CPU a step); off: Run over gRPC only",
        LOCAL_LINK_RULE,
    )
    registry: str = option("127.0.0.1:50053", "registry address")
    model: str = option(DEFAULT_MODEL_NAME, "model to serve, NAME or NAME:VERSION")
    device: str = option(
        "auto",
        "cpu, cuda, cuda:N or auto (CUDA when present)",
        Bound(
            lambda device: device in ("auto", "cpu") or device.startswith("cuda"),
            "must be auto, cpu, cuda or cuda:N",
        ),
    )
    dtype: str = option(
        "auto",
        "float32, bfloat16, float16 or auto (bfloat16 on CPUs with AMX or AVX512-BF16 and on "
        "GPUs that have it, float16 on older GPUs, float32 elsewhere)",
        one_of("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = option(
        "auto",
        "weight-only quantization at load: auto (a GGUF whose linears ship Q4_1: int4, Q8_0: "
        "int8, their values as they are; otherwise none), none, int8 (a GGUF's Q8_0 values, "
        "else per row) or int4 (groups of 32; a GGUF's Q4_1 values); CPU only, computes in "
        "bfloat16",
        TARGET_QUANTIZATIONS,
    )
    forward: str = option(
        "fast",
        "fast (Canteen's fused layers, for llama, mistral, qwen2, qwen3, granite) or "
        "transformers (the reference forward; always used for other families)",
        one_of("fast", "transformers"),
    )
    speculative: str = option(
        "none",
        "speculative decoding: none, or ngram (draft tokens looked up in the sequence's own "
        "prompt and output, verified in the same forward; the tokens are exactly those "
        "without it)",
        one_of(*SPECULATIVE_KINDS),
    )
    num_speculative_tokens: int = option(
        4, "most draft tokens per sequence and step, 1..16", within(1, 16)
    )
    draft_model: str = option(
        "",
        "with --speculative draft: the registry model (NAME or NAME:VERSION) that proposes "
        "drafts; it must share the served model's tokenizer (the same model with "
        "--draft-quantization int4 is a natural one)",
    )
    draft_quantization: str = option(
        "none", "the draft model's --quantization: none, int8, int4", QUANTIZATIONS
    )
    block_size: int = option(
        16,
        "tokens per KV block",
        one_of(8, 16, 32, 64, 128, rule="must be one of 8, 16, 32, 64, 128"),
    )
    kv_cache_memory: str = option("512MiB", "bytes of KV cache, e.g. 512MiB or 2GiB")
    memory_fraction: float = option(
        0.0,
        "share of device memory (CUDA) or available RAM (CPU) the worker may hold; the KV pool "
        "gets what the weights and warm-up leave (overrides --kv-cache-memory; 0: off)",
        within(0, 0.98, "must be in (0, 0.98], or 0 for --kv-cache-memory"),
    )
    num_kv_blocks: int = option(0, "exact number of KV blocks (overrides both above)", at_least(0))
    kv_host_bytes: str = option(
        "0",
        "bytes of host memory for prefix blocks evicted from the KV pool, e.g. 4GiB (on a CPU "
        "worker a budget of its own in the same RAM); 0: no host tier",
    )
    kv_disk_dir: str = option(
        "",
        "folder of the disk KV tier, where blocks evicted from the host tier go; it survives "
        "restarts, and workers of one node given the same folder share its blocks; '': none",
    )
    kv_disk_bytes: str = option("16GiB", "bytes the disk KV tier may hold (with --kv-disk-dir)")
    max_batched_tokens: int = flag("max_batched_tokens")
    cuda_graph_max_batch: int = option(
        32,
        "on CUDA with --forward fast, decode steps of up to this many sequences replay "
        "captured CUDA graphs (one launch instead of hundreds); 0: off",
        within(0, 512, "must be in 0..512 (0: off)"),
    )
    cuda_graph_max_context: int = option(
        2048, "the longest context (tokens) a graphed decode step attends over", within(1, 131072)
    )
    threads: int = option(0, "torch CPU threads (0: torch's default)", at_least(0))
    narrow_step_rows: int = option(
        NARROW_STEP_ROWS,
        "steps of at most this many token rows (a stream or two decoding) compute on one torch "
        "thread, leaving the other cores to gRPC and the edge; wider steps use --threads; the "
        "tokens are the same either way; 0 (the default): every step on --threads; helps only "
        "where other work loads the cores (docs/speed-history.md)",
        at_least(0),
    )
    small_step_mmacs: int = option(
        SMALL_STEP_MMACS,
        "steps whose linears make fewer million multiply-adds than this (a model of a few "
        "million parameters: a draft, a test model) compute on one torch thread, whatever "
        "their rows: a second thread's wake-ups cost more than it computes there, and it "
        "spins on a core the edge needs; the tokens are the same either way; 0: off",
        at_least(0),
    )
    grammar_compile_timeout: float = option(
        _GRAMMAR.compile_timeout,
        "seconds a constrained request's grammar may take to compile from its arrival; one "
        "that misses it fails that request alone (other sequences keep running meanwhile)",
        within(0.01, 600),
    )
    grammar_compile_threads: int = option(
        _GRAMMAR.num_compile_threads,
        "threads that compile grammars, off the step thread",
        within(1, 32),
    )
    grammar_mask_threads: int = option(
        _GRAMMAR.num_mask_threads,
        "threads that fill a step's token masks in parallel with the forward (0: llguidance's "
        "default: most of the CPUs, up to 32)",
        within(0, 64),
    )
    grammar_inline_mask_rows: int = option(
        _GRAMMAR.inline_mask_rows,
        "steps sampling at most this many constrained rows fill their token masks on the step "
        "thread, one row after another; more fill beside the forward (0: always beside)",
        within(0, 4096),
    )
    grammar_lexer_fuel: int = option(
        _GRAMMAR.lexer_fuel,
        "work one grammar's lexer may take to build (llguidance's initial_lexer_fuel)",
        within(1_000, 10**10),
    )
    grammar_step_lexer_fuel: int = option(
        _GRAMMAR.step_lexer_fuel,
        "lexer work one token's mask may take (llguidance's step_lexer_fuel)",
        within(1_000, 10**9),
    )
    grammar_step_max_items: int = option(
        _GRAMMAR.step_max_items,
        "parser items one token's mask may make (llguidance's step_max_items)",
        within(100, 10**8),
    )
    grammar_max_lexer_states: int = option(
        _GRAMMAR.max_lexer_states,
        "lexer states one grammar may build (llguidance's max_lexer_states)",
        within(100, 10**8),
    )
    grammar_max_size: int = option(
        _GRAMMAR.max_grammar_size,
        "symbols one grammar may have (llguidance's max_grammar_size)",
        within(100, 10**9),
    )
    max_loras: int = option(
        4,
        "most distinct LoRA adapters one step applies (the scheduler keeps to it); 0: requests "
        "naming an adapter are refused",
        within(0, 64),
    )
    max_cpu_loras: int = option(
        8,
        "most LoRA adapters kept loaded in memory, least recently used evicted; at least "
        "--max-loras",
        within(1, 1024),
    )
    max_lora_rank: int = option(64, "largest LoRA rank served, 1..64", within(1, 64))
    worker_id: str = option("", "worker id (default: generated)")
    grace: float = option(30.0, "seconds running sequences get to finish on SIGTERM", at_least(0))
    verify_checksum: bool = option(True, "check the weights' sha256 against the registry")

    def __post_init__(self) -> None:
        check_bounds(self)
        low_bit = "the low-bit kernels compute in it"
        require(
            self.quantization in ("none", "auto") or self.dtype in ("auto", "bfloat16"),
            "dtype",
            self.dtype,
            f"must be auto or bfloat16 with --quantization ({low_bit})",
        )
        require(
            (self.speculative == "draft") == bool(self.draft_model),
            "draft_model",
            self.draft_model or "''",
            "give a draft model with --speculative draft, and only with it",
        )
        require(
            self.draft_quantization == "none" or self.dtype in ("auto", "bfloat16"),
            "dtype",
            self.dtype,
            f"must be auto or bfloat16 with --draft-quantization ({low_bit})",
        )
        require(
            self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            self.max_cpu_loras,
            f"must be at least --max-loras ({self.max_loras}): a step's adapters are in memory",
        )
        parse_bytes(self.kv_cache_memory)
        parse_bytes(self.kv_host_bytes)
        parse_bytes(self.kv_disk_bytes)

    @property
    def graph_sizes(self) -> GraphSizes | None:
        if not self.cuda_graph_max_batch:
            return None
        return GraphSizes(self.cuda_graph_max_batch, self.cuda_graph_max_context)

    @property
    def grammar(self) -> GrammarOptions:
        return GrammarOptions(
            compile_timeout=self.grammar_compile_timeout,
            num_compile_threads=self.grammar_compile_threads,
            num_mask_threads=self.grammar_mask_threads,
            inline_mask_rows=self.grammar_inline_mask_rows,
            lexer_fuel=self.grammar_lexer_fuel,
            step_lexer_fuel=self.grammar_step_lexer_fuel,
            step_max_items=self.grammar_step_max_items,
            max_lexer_states=self.grammar_max_lexer_states,
            max_grammar_size=self.grammar_max_size,
        )

    @property
    def lora(self) -> LoraOptions:
        return LoraOptions(
            self.max_loras, self.max_cpu_loras, self.max_lora_rank, self.verify_checksum
        )

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)

    @property
    def kv_host_tier_bytes(self) -> int:
        return parse_bytes(self.kv_host_bytes)

    @property
    def kv_disk_tier_bytes(self) -> int:
        return parse_bytes(self.kv_disk_bytes) if self.kv_disk_dir else 0
