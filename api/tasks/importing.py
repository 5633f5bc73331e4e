"""A trainer's settings as an estimate request (`/v1/import`); pasted text is parsed, never run."""

from __future__ import annotations

import dataclasses
import shlex

from pydantic import ValidationError

from adapters.deepspeed_import import import_deepspeed
from adapters.megatron_import import import_megatron
from adapters.torchtitan_import import import_torchtitan
from wire.convert import resolve_model
from planner.errors import PlanningError
from wire.errors import field_errors, validation_detail
from wire.importing import ImportRequest, ImportResponse
from wire.schemas import EstimateRequest


def model_field(model) -> str | dict | None:
    """A request's model as the torchtitan importer takes it: a preset name, or an architecture's fields."""
    if model is None or isinstance(model, str):
        return model
    return dataclasses.asdict(resolve_model(model))


def import_for(request: ImportRequest) -> ImportResponse:
    """The estimate request the command line describes on `request`'s cluster, checked as /v1/estimate checks it
    (PlanningError, a 422, when the command line describes what no request can hold)."""
    if request.deepspeed_config is not None:
        imported = import_deepspeed(request.deepspeed_config, request.megatron_args, vocab_size=request.vocab_size)
    elif request.megatron_args is not None:
        imported = import_megatron(request.megatron_args, vocab_size=request.vocab_size)
    else:
        imported = import_torchtitan(shlex.join(request.overrides or []), toml=request.torchtitan_toml,
                                     model=model_field(request.model))
    body = {**imported.request, "cluster": request.cluster.model_dump(mode="json"),
            "failures": request.failures.model_dump(mode="json")}
    try:
        checked = EstimateRequest.model_validate(body)
    except ValidationError as error:
        errors = field_errors(error.errors(include_url=False, include_input=False))
        raise PlanningError(f"the command line describes a request resiplan cannot take: {validation_detail(errors)}") from None
    return ImportResponse(request=checked.model_dump(mode="json", exclude_none=True), not_modelled=imported.not_modelled,
                          ignored=imported.ignored, notes=imported.notes)
