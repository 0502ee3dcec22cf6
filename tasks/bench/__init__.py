"""The pure parts of the benchmarks (their Prefect flows are in flows/): quality and ablation
(``wsseg bench quality``), pipeline (``wsseg bench pipeline``), train (``wsseg bench train``)."""
