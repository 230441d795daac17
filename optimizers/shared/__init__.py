"""What the optimizer families share and none of them owns: multi-tensor buckets (buckets.py) and
gradient tables (grad_table.py), argument checks (checks.py), telemetry (telemetry.py), the table
of group steppers (steppers.py), the in-place tuning base (tuning.py) and the benchmark and tuning
workloads (workloads.py). Nothing here imports a family."""
