"""fedshard ClientApp: declares its keep ratio, trains the shard it receives (thin)."""

import copy
from dataclasses import replace

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedshard import handle_evaluate, handle_query
from fedshard.app.config import RunConfig
from fedshard.app.task import (
    client_dataset,
    low_memory_of,
    node_capacity,
    node_partition,
    resolve_device,
    template_model,
    train_node,
    warn_if_looks_simulated,
)
from fedshard.client import node_key_of, train_kind

app = ClientApp()


def _node(context: Context) -> tuple[RunConfig, int, int]:
    cfg = RunConfig.from_mapping(context.run_config)
    if "data-dir" in context.node_config:  # a deployed node's own data location wins
        cfg = replace(cfg, data_dir=str(context.node_config["data-dir"]))
    pid, num = node_partition(cfg, dict(context.node_config))
    return cfg, pid, num


@app.query()
def query(msg: Message, context: Context) -> Message:
    cfg, _, _ = _node(context)
    # its keep ratio, or the one its memory-mb allows (measured here, on its own batches)
    return handle_query(msg, node_capacity(cfg, dict(context.node_config)),
                        node_key_of(context))


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg, pid, num = _node(context)
    # a deployed node with a simulated node's config is warned (the ServerApp says where it runs)
    warn_if_looks_simulated(cfg, dict(context.node_config), msg.content.get("config"))
    # the shard of the process's shared model (only read), or width slicing's narrow model
    return train_node(msg, cfg, client_dataset(cfg, pid, num),
                      device=resolve_device(cfg.client_device), fast=cfg.fast,
                      low_memory=low_memory_of(dict(context.node_config))
                      and train_kind(msg) == "shard")


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    cfg, pid, num = _node(context)
    # handle_evaluate loads the global weights into the model it gets: a copy
    return handle_evaluate(msg, copy.deepcopy(template_model(cfg)), client_dataset(cfg, pid, num),
                           device=resolve_device(cfg.client_device))
