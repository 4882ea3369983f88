"""The `canteen` command's tools, apart from the shared runtime around them: `bench` (load
and capacity benchmarks), `chaos` (faults under load) and `up` (the whole suite on one
machine, supervised). The command itself is canteen/cli.py."""
