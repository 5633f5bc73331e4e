"""The reference trainer: runs any plan, uniform or not, with PyTorch on CPU over gloo, to show it trains
correctly (`resiplan-train`). Imports `wire` and `adapters.torch_csv`, never `api`."""
