"""What a target pass and a draft token cost on this machine: measured, cached per machine, corrected in use.

  table.py    Prices: what a step costs and commits, and the draft length that pays best; CostModel: the
              measured tables and their prices (a batch, a micro-batch, a draft batch, a step)
  batch.py    SharedBatch (a slot's prices in a batch shared with other slots) and MtpPrices (the MTP head as the
              drafter): Prices that hold a CostModel and price from it
  context.py  ContextCosts: a CostModel per context size
  learn.py    learning from observed passes (CostModel.observe): each batch shape by a function of its own
  timing.py   measure() and measure_together(): timing this machine's batches
  cache.py    cached_measure(): the per-machine cache (costs.json), its checks and `ggufspec doctor`'s report

The names other modules import are re-exported here.
"""

from .batch import MtpPrices, SharedBatch
from .cache import (ENTRY_FIELDS, MAX_SPREAD, MEASURE_TRIES, NOISY_RETRY_AFTER, cache_report, cached_measure,
                    cached_model, check_costs, costs_path, entry_noisy, fastest)
from .context import CONTEXT_SIZE, ContextCosts
from .table import CostModel, Prices
from .timing import LONG_BATCHES, MTP_CATCH_UP, measure, measure_together

__all__ = ["CONTEXT_SIZE", "ENTRY_FIELDS", "LONG_BATCHES", "MAX_SPREAD", "MEASURE_TRIES", "MTP_CATCH_UP",
           "NOISY_RETRY_AFTER", "ContextCosts", "CostModel", "MtpPrices", "Prices", "SharedBatch", "cache_report",
           "cached_measure", "cached_model", "check_costs", "costs_path", "entry_noisy", "fastest", "measure",
           "measure_together"]
