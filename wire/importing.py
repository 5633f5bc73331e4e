"""`/v1/import`: a trainer's own settings in, an estimate request out (API.md)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from wire.schemas import Cluster, Failures, _Strict

# A pasted command line with every flag Megatron-LM has is a few kB; this leaves room for comments and scripts.
MAX_COMMAND_LINE_CHARS = 100_000


class ImportRequest(_Strict):
    megatron_args: str = Field(
        max_length=MAX_COMMAND_LINE_CHARS,
        description="A Megatron-LM pretrain_gpt.py command line as pasted (shell quoting, line continuations and "
        "comments read as a shell reads them, never run); torchrun's --nnodes x --nproc-per-node before the "
        "script gives the replica count.")
    cluster: Cluster
    failures: Failures = Field(default_factory=Failures)
    vocab_size: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="The tokenizer's vocabulary, when the command line has no --vocab-size (Megatron reads it from "
        "the tokenizer); default: that of the model preset of the same shape, if any.")


class ImportResponse(BaseModel):
    request: dict = Field(description="An EstimateRequest (a PlanRequest with `layout`) for /v1/estimate or "
                          "/v1/compare, exactly as the command line describes the job.")
    not_modelled: list[str] = Field(description="Flags that change time or memory but are not in the cost model, "
                                    "each with why.")
    ignored: list[str] = Field(description="Flags read and set aside: they change neither time nor memory.")
    notes: list[str] = Field(default_factory=list, description="What was assumed, e.g. where the vocabulary came from.")
