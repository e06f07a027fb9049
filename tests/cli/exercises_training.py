"""Registry exercises that train: every config key, the model / optimizer / step-output members, precision,
partitioning, activation checkpointing, delayed initialization (see tests/cli/test_support_e2e.py)."""

from __future__ import annotations

from typing import Any

import torch

from exercises_common import (
    D,
    PP2_DP2,
    STEPS,
    assert_matches,
    batches,
    full_params,
    make_net,
    make_optimizer,
    reference,
    shard,
    train,
    train_and_compare,
)


def pipeline_with_data_parallelism(smp: Any) -> None:
    """pp = 2 x dp = 2, auto-partitioned: the core API, and the state it exposes, against plain PyTorch."""
    seen_tracing: list[bool] = []

    @smp.step
    def step(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen_tracing.append(smp.is_tracing())
        loss = torch.nn.functional.mse_loss(model.forward(x), y)
        model.backward(loss)
        return loss

    smp.init({**PP2_DP2, "auto_partition": True, "memory_weight": 0.5})
    assert smp.is_initialized() and smp.num_microbatches() == 2 and smp.state.cfg.memory_weight == 0.5
    model = smp.DistributedModel(make_net())
    opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    assert smp.state.model is model and smp.state.optimizer is opt
    assert smp.state.module_manager.translate_functions == []  # nothing swapped: names are the model's own
    train(smp, model, opt, step=step)
    assert_matches(full_params(smp, model), reference())
    if smp.pp_rank() == 0:  # the step body runs on pp_rank 0; rank 0 alone traces, once
        assert seen_tracing[-1] is False and any(seen_tracing) == (smp.rank() == 0), seen_tracing


def schedule_and_placement_keys(smp: Any) -> None:
    """The old key name, the other schedule and placement, a smaller in-flight window, ordered serving."""
    train_and_compare(smp, {"partitions": 2, "microbatches": 4, "ddp": True, "pipeline": "simple",
                            "placement_strategy": "spread", "deterministic_server": True})  # fmt: skip
    assert smp.state.cfg.pipeline == "simple" and smp.pp_size() == 2
    assert smp.pp_rank() == smp.rank() // 2  # "spread": pipeline stages outermost
    smp.reset()
    train_and_compare(smp, {**PP2_DP2, "microbatches": 4, "active_microbatches": 2, "pipeline": "interleaved",
                            "placement_strategy": "cluster"})  # fmt: skip
    assert smp.state.cfg.active_microbatches == 2
    assert smp.pp_rank() == smp.rank() % 2  # "cluster": a model replica's stages on neighbouring ranks


def manual_partition_and_model_members(smp: Any) -> None:
    """smp.partition / set_partition / default_partition, then every introspection member of the model."""
    smp.init({**PP2_DP2, "auto_partition": False, "default_partition": 1})
    net = make_net(smp=smp, partition_a=0)
    model = smp.DistributedModel(net)
    smp.set_partition(model.get_module().b, 0)
    assert model.get_module() is net and not model.partitioned
    hooks: list[str] = []
    model.register_post_partition_hook(lambda m, o: hooks.append("partition"))
    model.register_post_step_hook(lambda m, o: hooks.append("step"))
    opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train(smp, model, opt)
    assert model.partitioned and hooks == ["partition", "step"], hooks
    mine = {"a", "b"} if smp.pp_rank() == 0 else {"c"}
    names = {n for n, _ in model.local_named_parameters()}
    assert {n.split(".")[0] for n in names} == mine, names
    assert {id(p) for p in model.local_parameters()} == {id(p) for n, p in net.named_parameters() if n in names}
    assert {n for n, _ in model.local_named_buffers()} == ({"c.shift"} if "c" in mine else set())
    assert len(list(model.local_buffers())) == len(mine & {"c"})
    modules = {n.split(".")[0] for n, _ in model.local_named_modules() if n}
    assert mine <= modules and len(list(model.local_modules())) >= len(mine)
    assert model.is_local_parameter(net.a[0].weight) == (smp.pp_rank() == 0)
    assert model.is_local_buffer(net.c.shift) == (smp.pp_rank() == 1)
    assert model.get_param_name(net.b[0].bias) == "b.0.bias"
    assert model.distributed_modules() == [] and not model.is_distributed_parameter(net.c.linear.weight)
    assert not model.is_distributed_buffer(net.c.shift) and not model.is_scaled_batch_parameter(net.a[0].weight)
    assert not model.is_scaled_batch_buffer(net.c.shift)
    assert {n for n, _ in model.default_reducer_named_parameters()} == names  # tp = 1: all over the DP group
    assert list(model.scaled_batch_reducer_named_parameters()) == []
    assert_matches(full_params(smp, model), reference())


def step_output_members(smp: Any) -> None:
    """A step returning (loss, output) at pp = 1 x dp = 4: each StepOutput member on known values."""
    smp.init({"microbatches": 2, "ddp": True})
    model = smp.DistributedModel(make_net())

    @smp.step
    def forward(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(x)
        return out.sum(), out

    x = shard(smp, batches(1)[0][0])
    with torch.no_grad():
        total, out = forward(model, x)
        expected = model.get_module()(x)
    assert isinstance(out, smp.StepOutput) and len(out.outputs) == 2 and out.outputs[0].shape == (1, D)
    torch.testing.assert_close(out.concat(), expected)
    torch.testing.assert_close(out.stack(), expected.reshape(2, 1, D))
    torch.testing.assert_close(total.reduce_sum(), expected.sum())
    torch.testing.assert_close(total.reduce_mean(), expected.sum() / 2)
    torch.testing.assert_close(out.map(lambda t: t * 2).concat(), expected * 2)
    torch.testing.assert_close(out.detach().concat(), expected)  # Hugging Face's smp_nested_concat
    out.clear()
    assert len(out.outputs) == 0


def sixteen_bit(smp: Any) -> None:
    """fp16 and bf16 (fp32 master weights) at pp = 2 x dp = 2: close to fp32 PyTorch, loss falls."""
    for key, dtype, tol in (("fp16", torch.float16, 5e-3), ("bf16", torch.bfloat16, 3e-2)):
        smp.init({**PP2_DP2, key: True})
        with smp.model_creation(dtype=dtype):
            net = make_net()
        net.load_state_dict(make_net().state_dict())  # the reference's start (torch < 2.12 draws 16 bits apart)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        losses = train(smp, model, opt)
        assert losses[-1] < losses[0], (key, losses)
        assert all(p.dtype == dtype for _, p in model.local_named_parameters())
        assert_matches(full_params(smp, model), reference(), rtol=tol, atol=tol)
        smp.reset()


def sharded_optimizer_state(smp: Any) -> None:
    """shard_optimizer_state with Adam at pp = 2 x dp = 2: exactly plain PyTorch."""
    train_and_compare(smp, {**PP2_DP2, "shard_optimizer_state": True}, optimizer="adam")


def delayed_initialization(smp: Any) -> None:
    """Parameters on the meta device until partitioning, both ways of asking; a loaded state makes it exact."""
    initial = make_net(buffer=False).state_dict()
    expected = reference(net=lambda: make_net(buffer=False))
    for way in ("config key", "context manager"):
        smp.init({**PP2_DP2, "delayed_parameter_initialization": way == "config key"})
        creation = smp.model_creation() if way == "config key" else smp.delay_param_initialization(enabled=True)
        with creation:
            net = make_net(seed=3, buffer=False)
        assert all(p.is_meta for p in net.parameters()), way
        model = smp.DistributedModel(net)
        model.load_state_dict(initial)
        opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        train(smp, model, opt)
        assert not any(p.is_meta for _, p in model.local_named_parameters())
        assert_matches(full_params(smp, model), expected)
        smp.reset()


class _Checkpointed(torch.nn.Module):
    """The shared Net's layers, run through SMP's checkpoint functions (``how`` picks which)."""

    def __init__(self, smp: Any, how: str) -> None:
        super().__init__()
        net = make_net()
        self.a, self.b, self.c = net.a, net.b, net.c
        self.seq = torch.nn.Sequential(self.b, self.c)
        self.smp, self.how = smp, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "patches":
            ckpt = self.smp.patches.checkpoint
            return ckpt.checkpoint_sequential(self.seq, ckpt.checkpoint(self.a, x))
        return self.smp.checkpoint_sequential(self.seq, self.smp.checkpoint(self.a, x), strategy="each")


def activation_checkpointing(smp: Any) -> None:
    """set_activation_checkpointing at pp = 2 (offload_activations on: a no-op on CPU), then the functions."""
    smp.init({**PP2_DP2, "offload_activations": True})
    net = make_net()
    calls = _count_forwards(net.b)
    model = smp.DistributedModel(net)
    smp.set_activation_checkpointing(model.get_module().b)
    opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train(smp, model, opt)
    assert_matches(full_params(smp, model), reference())
    if model.is_local_parameter(model.get_module().b[0].weight):  # recomputed in backward: twice per microbatch
        assert len(calls) >= 2 * 2 * STEPS, len(calls)
    smp.reset()
    expected = reference()
    for how in ("smp", "patches"):
        smp.init({"microbatches": 2, "ddp": True})
        net = _Checkpointed(smp, how)
        calls = _count_forwards(net.a)
        model = smp.DistributedModel(net)
        opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
        train(smp, model, opt)
        assert len(calls) == 2 * 2 * STEPS, (how, len(calls))
        assert_matches({k: v for k, v in full_params(smp, model).items() if not k.startswith("seq.")}, expected)
        smp.reset()


class _CountingLinear(torch.nn.Linear):
    """A Linear that counts its forward runs (a recomputation calls forward, not always __call__ and its hooks)."""

    calls: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        return super().forward(x)


def _count_forwards(sequential: torch.nn.Sequential) -> list[int]:
    """Swap the Sequential's first Linear for a counting one with the same weights; return its call list."""
    old = sequential[0]
    new = _CountingLinear(old.in_features, old.out_features)
    new.load_state_dict(old.state_dict())
    new.calls = []
    sequential[0] = new
    return new.calls


def amp_grad_scaler(smp: Any) -> None:
    """smp.amp.GradScaler scaling the loss in the step and stepping the optimizer, pp = 2 x dp = 2, fp32."""
    smp.init(PP2_DP2)
    model = smp.DistributedModel(make_net())
    opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    scaler = smp.amp.GradScaler()
    train(smp, model, opt, scaler=scaler)
    assert scaler.get_scale() == 2.0**16
    assert_matches(full_params(smp, model), reference())


def sharded_data_parallelism(smp: Any) -> None:
    """sdp = 2 in two replicas (4 ranks), clipping off: exactly plain PyTorch; a parameter registered with
    smp.register_parameter stays in one FSDP unit with its borrower."""
    smp.init({"ddp": True, "microbatches": 2, "sharded_data_parallel_degree": 2, "sdp_gradient_clipping": 0.0})
    net = make_net()
    smp.register_parameter(net.c, net.a[0].weight)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(make_optimizer("sgd", model.parameters()))
    train(smp, model, opt)
    assert_matches({k: v.detach().float() for k, v in model.state_dict().items()}, reference())
    smp.reset()


def tensor_parallelism(smp: Any) -> None:
    """tp = 2 x rdp = 2: a model of smp.nn modules made under smp.model_creation equals plain PyTorch."""
    import tp_models as tm

    def build() -> torch.nn.Module:
        net = tm.TinySmpLM(smp.nn)
        net.ln = smp.nn.FusedLayerNorm(tm.HIDDEN)
        return net

    ref_losses, ref_params = tm.reference(build)  # before smp.init: smp.nn modules are whole
    smp.init({"tensor_parallel_degree": 2, "ddp": True, "prescaled_batch": False, "optimize": "speed",
              "tensor_parallel_seed": 3})  # fmt: skip
    with smp.model_creation(tensor_parallelism=True):
        torch.manual_seed(0)
        net = build()
    model = smp.DistributedModel(net)
    assert all(isinstance(m, smp.nn.DistributedModule) for m in model.distributed_modules())
    assert isinstance(net.transformer, smp.nn.DistributedTransformer) and isinstance(net.proj, smp.nn.DistributedLinear)
    assert isinstance(net.transformer.seq_layers[0].output, smp.nn.DistributedTransformerOutputLayer)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))

    @smp.step
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches():
        opt.zero_grad()
        losses.append(sum(smp.allgather(step(tm.my_samples(smp, ids)).reduce_mean().item(), smp.DP_GROUP)) / 4)
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_matches({k: v.detach() for k, v in model.state_dict().items()}, ref_params, rtol=1e-5, atol=1e-5)
    smp.reset()


def tensor_parallelism_with_pipeline(smp: Any) -> None:
    """pp = 2 x tp = 2: user blocks swapped through smp.tp_register_with_module and @smp.tp_register, marked with
    smp.tensor_parallelism() and smp.set_tensor_parallelism, one per stage, equal plain PyTorch."""
    import tp_models as tm
    from smp_compat.nn.swap import swap_modules

    hidden, inner = tm.HIDDEN, 2 * tm.HIDDEN

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(hidden, inner), torch.nn.Linear(inner, hidden)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x + self.fc2(torch.relu(self.fc1(x))),)

    class DistBlock(smp.nn.DistributedModule):
        def __init__(self, hidden_dropout_prob: float = 0.1) -> None:
            super().__init__()
            self.output = smp.nn.DistributedTransformerOutputLayer(hidden, inner, hidden_dropout_prob, "relu",
                                                                   pre_layernorm=True, post_layernorm=False)  # fmt: skip

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.output(x)

    hooks = (lambda: ((), {}), lambda x: ((x,), {}), lambda out: (out,))
    smp.tp_register_with_module(Block, DistBlock, *hooks)

    @smp.tp_register(DistBlock, *hooks)
    class OtherBlock(Block):
        pass

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = torch.nn.Embedding(tm.VOCAB, hidden)
            with smp.tensor_parallelism(hidden_dropout_prob=0.0):
                first = Block()
            self.blocks = torch.nn.ModuleList([first, OtherBlock()])
            smp.set_tensor_parallelism(self.blocks[1], True, hidden_dropout_prob=0.0)
            self.head = torch.nn.Linear(hidden, tm.VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.embedding(ids)
            for block in self.blocks:
                h = block(h)[0]
            return self.head(h)

    ref_losses, ref_params = tm.reference(lambda: swap_modules(Net()))  # before smp.init: whole modules
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
              "auto_partition": False, "default_partition": 0})  # fmt: skip
    torch.manual_seed(0)
    model = smp.DistributedModel(Net())
    net = model.get_module()
    assert [type(b).__name__ for b in net.blocks] == ["DistBlock", "DistBlock"]
    smp.set_partition(net.blocks[1], 1)
    smp.set_partition(net.head, 1)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))

    @smp.step
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = tm.lm_loss(model(ids), ids)
        model.backward(loss)
        return loss

    losses = []
    for ids in tm.batches():
        opt.zero_grad()
        losses.append(sum(smp.allgather(step(tm.my_samples(smp, ids)).reduce_mean().item(), smp.DP_GROUP)) / 2)
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    full = {k: v.detach() for k, v in model.state_dict().items()}  # gathered over tp, then pp, on pp_rank 0
    if smp.pp_rank() == 0:
        assert_matches(full, ref_params, rtol=1e-5, atol=1e-5)
    smp.reset()


TRAINING = [pipeline_with_data_parallelism, schedule_and_placement_keys, manual_partition_and_model_members,
            step_output_members, sixteen_bit, sharded_optimizer_state, delayed_initialization,
            activation_checkpointing, amp_grad_scaler, sharded_data_parallelism, tensor_parallelism,
            tensor_parallelism_with_pipeline]  # fmt: skip
assert STEPS >= 2  # the loss must have a chance to fall
