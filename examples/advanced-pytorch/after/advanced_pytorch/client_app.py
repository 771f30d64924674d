"""advanced_pytorch: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from fedshard import ShardingClientApp, receive

from advanced_pytorch.task import Net, load_data
from advanced_pytorch.task import test as test_fn
from advanced_pytorch.task import train as train_fn

# Flower ClientApp
app = ShardingClientApp(keep_ratios="0.25:0.5,0.5:0.5")

# Where each node keeps its own classification head between rounds (`context.state`)
HEAD = "classification-head"


def load_personal_head(net: Net, context: Context) -> None:
    """Replace the global classification head with this node's own, once it has one."""
    if HEAD in context.state.array_records:
        net.head.load_state_dict(context.state[HEAD].to_torch_state_dict())


def node_data(context: Context):
    """This node's train and validation loaders."""
    return load_data(
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        context.run_config["dirichlet-alpha"],
    )


@app.train()
def train(msg: Message, context: Context):
    """Train the global model, with this node's personal head, on local data."""

    # Load the model, initialize it with the received weights, then use the personal head
    model = Net()
    shard = receive(msg, model)
    model = shard.model
    load_personal_head(model, context)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    # Train with the round's learning rate
    trainloader, _ = node_data(context)
    train_loss = train_fn(
        model,
        trainloader,
        context.run_config["local-epochs"],
        msg.content["config"]["lr"],
        device, shard.rules.attach,
    )

    # Keep the trained head for this node's next rounds
    context.state[HEAD] = ArrayRecord(model.head.state_dict())

    # Construct and return reply Message
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the global model, with this node's personal head, on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    load_personal_head(model, context)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")

    _, valloader = node_data(context)
    eval_loss, eval_acc = test_fn(model, valloader, device)

    metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc, "num-examples": len(valloader.dataset)}
    content = RecordDict({"metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
