"""The GEAR credit core: pure PyTorch, no trainer imports.

`token_advantages` turns sequence advantages (N,) into per-token advantages (N, T) with any
method of the registry (`METHODS`, `gear.credit.registry`, which also declares the per-token
signal names once); `credit_details` also returns what logging and visualisation need;
`gear.credit.signals` computes the per-token KL and entropy.
"""

# importing the methods registers the built-in ones, so they are in METHODS whenever any module
# of gear.credit is imported (a CreditParams checks its method's name against METHODS)
from gear.credit import methods as methods
from gear.credit.core import CreditDetails, credit_details, token_advantages
from gear.credit.params import CreditParams
from gear.credit.registry import METHODS, CreditInputs, MethodOutput, register_method
from gear.credit.signals import TokenSignals, signals_from_hidden, signals_from_logits

__all__ = [
    "METHODS",
    "CreditDetails",
    "CreditInputs",
    "CreditParams",
    "MethodOutput",
    "TokenSignals",
    "credit_details",
    "register_method",
    "signals_from_hidden",
    "signals_from_logits",
    "token_advantages",
]
