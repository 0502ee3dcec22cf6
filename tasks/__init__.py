"""wsseg's work, grouped by what it is for (flows/ wires it into Prefect flows; models/ holds the
networks): config (every option and default, once), corpus (a user's data in), wsss (method A,
a module per step), edges (method B), highres (method C, inference of large images), common
(training and metrics shared by the methods), labels (the labels out: export), bench (the
benchmarks), report (pictures, tables, status), runtime (MLflow, progress, memory), store (the
only code that knows paths and formats).
Imports go one way: flows -> tasks -> models (tools/import_graph.py checks it)."""
import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. With the default
# (active) policy a 2-thread torch process next to any other busy process was measured 8x
# slower on 2 cores (MLP training 90.7 s against 10.3 s passive, 10.8 s on one thread).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
