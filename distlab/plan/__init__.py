"""The planner: ``python -m distlab.plan`` (``__main__.py``), its calibration, link table, cost model, and
its checks against what can run (``validate.py``) and what is published (``published.py``)."""
