"""Where the compensators go: damage per module as 1 − CKA of the final hidden states (cka.py,
damage.py), the entropy- and cost-aware allocation of ranks under a memory budget (allocate.py,
budget.py), plans on disk and their picture (plan.py, plot.py)."""
