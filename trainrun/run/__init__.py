"""The run's lifecycle: the configuration checked against the files (`validity`), the set-up before the first step
(`startup`), the loop (`runner`), its stops (`stopping`), its end (`finish`), resuming (`resume`), and the run
directory (`rundir`, `lock`)."""
