"""The experiments layer, between the entry points (``dynamo ablate``, ``dynamo compare``, ``dynamo confirm``) and
launch: many training runs of one recipe, compared.

- :mod:`.variants`: the one registry of variants (a variant's ``--algo``, overrides and label; a Table 1
  baseline's loss, config change and label are registered together in ``algorithms/baselines.py``, which the
  trainer's ``--algo`` reads) and the groups of ``--variants``; :mod:`.paper` with ``paper_tables.json``: the
  paper's numbers, as data.
- Plan (:mod:`.plan`; ``dynamo ablate``'s :mod:`.ablation`, ``dynamo compare``'s :mod:`.comparison`) ->
  Executor (:mod:`.executor`: the process pool, resume of finished runs, Ctrl-C / SIGTERM) -> Collector
  (:mod:`.collector`: each run's metrics, evaluation and state) -> Analysis (:mod:`.analysis`, :mod:`.stats`;
  :mod:`.confirmatory` and :mod:`.paired_stats` for the preregistered tests) -> the files (:mod:`.tables`,
  :mod:`.plot`, :mod:`.outputs`, :mod:`.raw_data`, :mod:`.confirmatory_tables`); :mod:`.provenance`: the machine
  and warm-up every run's numbers come from (a seed's runs share both; the raw data carries an experiment across
  machines).

``report/`` stays the stage that renders one or more runs' curves (``dynamo report``, the ablation's report page);
what compares variants over seeds lives here, next to the registry it reads.
"""
