"""/v1/import: a trainer's own settings in, an estimate request out."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.core.body import body_openapi, json_body
from api.routes.plans import SOLVE_RESPONSES, V1_RESPONSES
from api.tasks.importing import import_for
from wire.importing import ImportRequest, ImportResponse

router = APIRouter(prefix="/v1", tags=["import"], responses=V1_RESPONSES)

_EXAMPLE = {
    "megatron_args": "torchrun --nnodes 4 --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 8 "
                     "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --swiglu "
                     "--untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope "
                     "--disable-bias-linear --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 --bf16",
    "cluster": {"num_nodes": 4, "gpus_per_node": 8, "gpu": "A100-80GB"},
}


@router.post("/import", response_model=ImportResponse, responses={413: SOLVE_RESPONSES[413]},
             openapi_extra=body_openapi(ImportRequest, {"megatron": {"summary": "a Megatron-LM command line",
                                                                       "value": _EXAMPLE}}))
async def import_settings(request: Annotated[ImportRequest, json_body(ImportRequest)]) -> ImportResponse:
    """The estimate request a Megatron-LM command line describes on this cluster, the flags that change time or
    memory but are not modelled, and those ignored because they change neither. The text is parsed, never run."""
    return await run_in_threadpool(import_for, request)
