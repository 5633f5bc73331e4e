"""Reference executor: train a small GPT on CPU/gloo exactly as a (possibly non-uniform) plan lays it out.

    torchrun --nproc-per-node W -m executor.cli --plan A.json [--reconfigure STEP:B.json ...]
        [--steps N] [--seed S] [--optimizer sgd|adam] [--lr LR] [--slow-device NODE:GPU:FACTOR[@STEP] ...]
        [--telemetry OUT.jsonl] [--layers L] [--hidden H] [--ffn F] [--vocab V] [--seq S] [--out-dir DIR]
        [--server URL [--token T] [--detect-every K]] [--emulate-ms-per-layer MS]
    resiplan-train --reference --plan A.json [same model and optimizer options]   # one process, no layout

(or, installed as the `resiplan-train` console script, `torchrun --nproc-per-node W
--no-python resiplan-train --plan PLAN.json ...`).

W is the number of devices the plans use (every stage's devices, of every plan). It runs what
the plan says and nothing else, so a non-uniform plan (replicas with different
TP degrees, layer splits or microbatch counts) trains to the same numbers as
one process training the whole batch: the point is to show that such plans are
executable and correct, not to be fast.

Rank mapping. Rank i runs the i-th device any of the plans uses, in sorted order,
sorting `"<node>:<gpu>"` numerically by (node, gpu): with used devices 0:0, 1:0,
1:1 rank 0 is 0:0, rank 1 is 1:0 and rank 2 is 1:1. A rank whose device the
current plan does not use (a failed GPU, a spare) joins every group creation and
migration and otherwise idles; it may hold state again in a later plan. A stage's
devices must be listed in device order (TP rank i on its i-th lowest rank, as
DTensor places shards; the service's plans are).

Process groups (gloo, all created by every rank in the same order):
  * Stage group per stage of more than one device: the stage's ranks. Its
    lowest rank is the stage's *leader*; the others are *followers*.
  * TP group per context-parallel rank of a stage with tp > 1 (the stage
    group when cp is 1): a stage's tp x cp devices are cp TP groups of tp
    consecutive devices (Megatron-LM's rank order, TP fastest).
  * CP group per TP rank of a stage with cp > 1: the stage's ranks holding
    that TP shard, one per context-parallel rank.
  * PP group per replica: the leaders of its stages. PyTorch's pipelining
    runtime runs on it, so only leaders send activations between stages.
  * Gradient-sync group per distinct set of leaders holding the same layer in
    every replica (layers with the same set share the group).

Model. A llama-style decoder built from `plan.architecture` (RMSNorm, RoPE,
GQA attention, SwiGLU or GELU MLP or routed experts, untied embedding and LM
head, mean token cross-entropy). Every parameter is initialised from a generator seeded by
(seed, parameter name), where the name carries the layer index
(`layers.7.wq.weight`), so every replica and every sharding starts from the
same full weights. A plan for a big model is shrunk (see `model_config`):
`--hidden/--ffn/--vocab/--seq/--layers` override it; the head counts are kept,
so the plan's TP degrees still divide them. `tied_embeddings` is ignored: the
executor (and its reference) always unties.

Model chunks. Replica r with p stages and the plan's v = virtual_stages runs
p * v chunks; chunk c of stage s is PyTorch's virtual stage c * p + s (looped
placement, as in adapters/torch_csv.py). Stage s's layer count (its `layers`
range) is split into v near-equal runs, earlier chunks taking the remainder,
and the runs are laid out in virtual-stage order; with v = 1 chunk 0 holds
exactly `layers`. The embedding is on virtual stage 0, final norm + LM head +
loss on the last.

Context parallelism (a stage's `cp`): every rank of the stage receives the
chunk's whole input; each CP rank runs the chunk's layers on its positions of
every sequence, Megatron-LM's load-balanced causal split (2 cp equal pieces,
rank c holding pieces c and 2 cp - 1 - c), with RoPE at those positions and
its queries attending over the keys and values all-gathered from its CP group
under a causal mask by position; the layers' output is all-gathered back to
whole sequences, and the embedding, final norm and head run on whole
sequences on every CP rank alike. The backward of the split gathers the
input's gradient, that of the key/value gather sums every rank's and keeps
its own positions. A layer's gradients are summed over the CP group before
the cross-replica sync (each CP rank saw only its positions); the embedding's
and head's are already whole. Stages with and without CP mix freely.

Mixtures of experts (the plan's `num_experts`): a softmax router picks each token's top k experts and
renormalizes their weights; routed experts are SwiGLU/GELU MLPs `ffn` wide, shared experts one more MLP, and
the first `dense_layers` layers dense. With expert parallelism (`ep` > 1, single-GPU stages only) ep
consecutive replicas form an EP group per stage: replica r holds block r mod ep of the routed experts, runs
them on the tokens of every replica of its group (all-gathered with their routing weights) and the outputs
are summed back to each token's replica (an all-reduce, then its own rows); backward mirrors both. An
expert's gradients are their own sync unit, reduced among the replicas holding it. One plan only (no
checkpoints or live switches), SGD or Adam; Adam's moments of a mixture of experts are sharded by the executor
itself (`Runtime.optimizer_parts`), not by the service's holdings.

Tensor parallelism is PyTorch's: each chunk is `parallelize_module`d on a
DeviceMesh built from the rank's TP group (q/k/v and gate/up projections
ColwiseParallel, out and down projections RowwiseParallel, the embedding
vocab-parallel RowwiseParallel, the LM head ColwiseParallel gathering its
logits); norms are replicated. The attention and MLP inputs become replicated
DTensors once per sublayer (PrepareModuleInput), so projections sharing an
input add their partial input gradients locally: one all-reduce per sublayer
forward and one backward, as in Megatron-LM.

A stage's TP degree may differ from its neighbours' (the planner does that),
so TP ranks cannot each run their own pipeline lane. Instead the leader alone
is a `PipelineStage` driven by `_PipelineScheduleRuntime`, which loads the
replica's torch-csv export (rows reordered to the PP group's rank order, since
a stage's leader need not have a lower rank than the next stage's). Its chunk
is wrapped so that forward first broadcasts the chunk input to the stage group,
and backward first broadcasts the output gradient (an autograd function on the
chunk output). Each follower replays the same CSV row: for `F` it receives the
input and runs its shard of the chunk, for `B`, `I` and `W` it calls the same
`torch.distributed.pipelining._backward` functions the stage calls (with the
same first-stage special cases), so every DTensor collective inside the chunk
happens in the same order on all the stage's ranks.

Gradient synchronisation, after each step's schedule, for every sync unit
(the embedding, each layer, the final norm + head) in one global order, which
keeps the overlapping groups deadlock-free:
  1. every rank holding the unit gathers its gradients to full tensors (one
     all-gather of all its shards over the TP group; replicated norms are
     already full), and a layer's are summed over the CP group;
  2. the leaders of the replicas holding the unit all-reduce the flattened
     full gradients, each contributing its sum of microbatch mean-loss
     gradients times `micro_batch_size / global_batch_size`: that is its
     replica's mean gradient weighted by the replica's share
     `num_microbatches * micro_batch_size / global_batch_size` of the global
     batch, so the sum is the full-batch mean gradient whatever the TP
     degrees, layer splits and microbatch counts;
  3. the leader broadcasts the result to its stage group and every rank keeps
     its own shard (`distribute_tensor` without communication).
Then the optimizer: plain SGD on every rank's slice, or Adam (`optimizer.py`)
with its moments sharded as the plan's `zero_stage` says (whole TP slice, or the
share of replicas x CP ranks with ZeRO-1, exactly as `planner.replan.holdings` lays state out): each
rank updates what it owns and the owners of a unit sum their updated parts.
`grad_weighting="uniform"` averages replicas equally instead (wrong for unequal
microbatch counts: the tests' negative control).

Live reconfiguration (`--reconfigure STEP:B.json`, B a replan's answer). At the
start of STEP every rank creates B's groups, builds B's chunks (NaN-filled), keeps
what it held itself and executes exactly B's `migration.transfers` (`migrate.py`),
then runs B's pipeline from STEP on. The step count, the global batch and the data
order carry on, so the losses are those of one process (`--reference`); the
events (`events.jsonl`) list every transfer with the bytes that went over the wire.

The live loop (`--server URL`, `live.py`): every K steps rank 0 posts the ranks' telemetry
of the current plan to `/v1/detect`; a newly flagged device brings a replan
(`POST /v1/plans/{id}/replan`), which every rank applies as above at the next
step. `--emulate-ms-per-layer MS` makes ranks behave like GPUs for throughput
measurements (`timing.py`): ops last their work's emulated time, not the host's
contended CPU time.

Telemetry. Each rank times each compute op it runs (F, B, I, W, recorded by
microbatch), so a microbatch's `compute_ms` is the sum over the rank's ops and
chunks for it. The time is the thread's CPU time (`timing.py`): waits for
pipeline receives and inside TP collectives are not the device's compute, so a
slow GPU's TP partner reports its own speed. `--slow-device NODE:GPU:F@STEP`
makes that device sleep (F - 1) times each op's compute after the op from STEP
on (spinning the last 2 ms, as a plain sleep wakes late on a busy host), and
report F times it.
Rank 0 writes one JSON line per device and iteration it ran in API.md's `/v1/detect`
telemetry item format; sequences are not packed, so `seq_lengths` is the
sequence length once per sequence of the microbatch.

A plan using one device also runs without torchrun.

PyTorch's pipelining runtime is private API (`_PipelineScheduleRuntime`,
`_load_csv`, `_backward`) and may move; this is written against torch 2.13.

Outputs (`--out-dir`): `losses.jsonl` (`{"step", "loss", "plan_id", "step_s"}`), `events.jsonl`
(`reconfigure` with regroup/transfer/reassembly seconds, and one `transfer` per executed transfer:
the wire transfer plus `bytes` sent and the plan's `plan_bytes`), and each rank's final parameters.

Modules: `model` (the decoder, data, loss, TP plan, the single-process reference), `layout` (rank ->
device, stage, chunk, layers; sync units), `runtime` (one plan's groups, chunks and pipeline on a rank),
`shards` (where a rank's state lies in the transfers' coordinates), `optimizer` (SGD, sharded Adam),
`migrate` (executing a replan's transfers), `tensor_parallel` (the leader/follower protocol around a
chunk), `timing` (op timers, injected slowdowns), `run` (one rank's run over its plans), `cli`
(`resiplan-train`). Imports `wire`, `adapters.torch_csv` and `planner.replan.holdings`, never `api`.
"""
