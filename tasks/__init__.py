"""wsseg tasks."""
import os

# Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning. With the default
# (active) policy a 2-thread torch process next to any other busy process was measured 8x
# slower on 2 cores (MLP training 90.7 s against 10.3 s passive, 10.8 s on one thread).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
