"""The pure parts of the benchmarks (their Prefect flows are in flows/): quality and ablation
(``wsseg bench quality``), pipeline (``wsseg bench pipeline``), train (``wsseg bench train``); the
provenance each benchmark's JSON records (command, date, machine) and ``wsseg bench report``, the
page of today's figures made from those JSONs."""
