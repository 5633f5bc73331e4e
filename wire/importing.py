"""`/v1/import`: a trainer's own settings in, an estimate request out (API.md)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from wire.schemas import Cluster, Failures, ModelField, _Strict

# A pasted command line with every flag Megatron-LM has is a few kB; this leaves room for comments and scripts.
MAX_COMMAND_LINE_CHARS = 100_000


class ImportRequest(_Strict):
    megatron_args: str | None = Field(
        default=None, max_length=MAX_COMMAND_LINE_CHARS,
        description="A Megatron-LM pretrain_gpt.py command line as pasted (shell quoting, line continuations and "
        "comments read as a shell reads them, never run); torchrun's --nnodes x --nproc-per-node before the "
        "script gives the replica count.")
    torchtitan_toml: str | None = Field(
        default=None, max_length=MAX_COMMAND_LINE_CHARS,
        description="An older torchtitan's TOML job file ([parallelism], [training], [activation_checkpoint]).")
    overrides: list[Annotated[str, Field(max_length=MAX_COMMAND_LINE_CHARS)]] | None = Field(
        default=None, max_length=1024,
        description="torchtitan `--section.field value` overrides (torchtitan 0.3 is configured by them; a "
        "launch command's words work too, `--module`/`--config` and torchrun's flags included); on top of "
        "torchtitan_toml when both are given.")
    deepspeed_config: dict | None = Field(
        default=None, description="A DeepSpeed config (ds_config.json); give the Megatron-DeepSpeed command line "
        "beside it as megatron_args (or use the DeepSpeed export's, whose \"resiplan\" key says the model).")
    model: ModelField | None = Field(
        default=None, description="torchtitan only: the model, where `--module`/`--config` name no config "
        "function resiplan reads (torchtitan builds its model in Python).")
    cluster: Cluster
    failures: Failures = Field(default_factory=Failures)
    vocab_size: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="The tokenizer's vocabulary, when the command line has no --vocab-size (Megatron reads it from "
        "the tokenizer); default: that of the model preset of the same shape, if any.")


    @model_validator(mode="after")
    def _one_trainer(self) -> ImportRequest:
        given = [name for name, value in (("megatron", self.megatron_args or self.deepspeed_config),
                                          ("torchtitan", self.torchtitan_toml or self.overrides)) if value]
        if len(given) != 1:
            raise ValueError("give megatron_args, deepspeed_config (with the megatron_args it runs beside), or "
                             "torchtitan_toml and/or overrides: one trainer's settings")
        if given == ["megatron"] and self.model is not None:
            raise ValueError("model is read from megatron_args; give it only with torchtitan settings")
        return self


class ImportResponse(BaseModel):
    request: dict = Field(description="An EstimateRequest (a PlanRequest with `layout`) for /v1/estimate or "
                          "/v1/compare, exactly as the command line describes the job.")
    not_modelled: list[str] = Field(description="Flags that change time or memory but are not in the cost model, "
                                    "each with why.")
    ignored: list[str] = Field(description="Flags read and set aside: they change neither time nor memory.")
    notes: list[str] = Field(default_factory=list, description="What was assumed, e.g. where the vocabulary came from.")
