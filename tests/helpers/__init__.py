"""What the tests share and no test runs: the parity rule and its worlds (parity, distributed, rank_preload), the plain
references (reference, trl_dpo_reference, chat_data), the machine's fixtures (ds_ops, verl_site, slurm_cluster,
fault_plugin, wandb_reader) and the suite's own tools (counts, timeline). Imported as `helpers.<module>` (pytest puts
tests/ on the path)."""
