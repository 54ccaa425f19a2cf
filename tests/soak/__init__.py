"""The chaos soak (issue 32): the pipeline set up as in production, broken on a schedule, healing with no person.

- `site`: the set-up (Prefect server and automations, `rlhf/full` deployed, a supervised process worker, a Ray
  cluster of 2 nodes, moto, the power-cut filesystem) and the soak's only calls that change a run;
- `kinds`: one function per fault kind;
- `soak`: the legs, the seeded schedule, the uninterrupted and the faulted runs, the injector;
- `observe`: what the faults are timed from (the ranks' trace, the run's logs, its Prefect states, the store);
- `report`: the rows, the totals, `soak_report.json` and the Prefect artifact.

`make soak` runs `python -m tests.soak`; tests/integration/test_soak.py the short version. docs/development.md
("The chaos soak") has the kinds and the measures.
"""
