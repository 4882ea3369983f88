"""Serving benchmarks against a running gateway, and capacity planning from a sweep.

From Python::

    from canteen.tools.bench import Concurrency, Target, random_workload, run_bench

    run = asyncio.run(run_bench(Target(address="127.0.0.1:50051"),
                                random_workload(64, 128, 64), Concurrency(8)))
    print(run.summary.output_throughput)
"""

from canteen.tools.bench.capacity import (
    CapacityPlan,
    LevelFigures,
    NoLevelMeetsSloError,
    level_figures,
    num_instances,
    plan_capacity,
)
from canteen.tools.bench.clients import Target, open_client
from canteen.tools.bench.records import RequestRecord, RequestSpec
from canteen.tools.bench.report import format_run, format_sweep, report_to_dict, runs_from_dict
from canteen.tools.bench.runner import (
    BenchRun,
    Concurrency,
    Limits,
    Mode,
    Rate,
    poisson_gaps,
    run_bench,
    run_sweep,
    run_with,
)
from canteen.tools.bench.stats import Distribution, RunSummary, Slo, percentile, summarize
from canteen.tools.bench.workload import (
    DatasetError,
    Workload,
    load_jsonl,
    random_workload,
    shared_prefix_workload,
)

__all__ = [
    "BenchRun",
    "CapacityPlan",
    "Concurrency",
    "DatasetError",
    "Distribution",
    "LevelFigures",
    "Limits",
    "Mode",
    "NoLevelMeetsSloError",
    "Rate",
    "RequestRecord",
    "RequestSpec",
    "RunSummary",
    "Slo",
    "Target",
    "Workload",
    "format_run",
    "format_sweep",
    "level_figures",
    "load_jsonl",
    "num_instances",
    "open_client",
    "percentile",
    "plan_capacity",
    "poisson_gaps",
    "random_workload",
    "report_to_dict",
    "run_bench",
    "run_sweep",
    "run_with",
    "runs_from_dict",
    "shared_prefix_workload",
    "summarize",
]
