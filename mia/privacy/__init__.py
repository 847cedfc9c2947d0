"""What membership scores prove about a training's differential privacy: bounds, estimates and checks. No model.

``one_run``   the one-run audit of Steinke, Nasr and Jagielski (2023) and its f-DP form (Mahloujifar, Melis and
              Chaudhuri 2025): lower bounds on epsilon from randomly included canaries, p-values of a claimed
              (epsilon, delta) or mu; group privacy; ``AuditViolation`` when a lower bound exceeds the accountant's
              upper bound.
``gdp``       Gaussian differential privacy (Dong, Roth and Su 2019): the trade-off curve, its (epsilon, delta)
              profile and the Gaussian-DP estimate of epsilon from scores.
``exposure``  the exposure of inserted canaries (Carlini et al. 2019).

The threshold bounds on (FPR, FNR) of one attack (``epsilon_bound``, Clopper-Pearson) live in ``mia.metrics``.
"""
