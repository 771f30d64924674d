"""pytorchlightning_example: A Flower / PyTorch Lightning app."""

import lightning.pytorch as pl
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from fedshard import ShardingClientApp as ClientApp, receive

from pytorchlightning_example.task import LitAutoEncoder, load_data

# Flower ClientApp
app = ClientApp()


def make_trainer(**kwargs) -> pl.Trainer:
    """A quiet Trainer: the server keeps the model, so the node writes no checkpoints or logs."""
    return pl.Trainer(enable_progress_bar=False, enable_model_summary=False, logger=False,
                      enable_checkpointing=False, **kwargs)


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""

    # Load the model and initialize it with the received weights
    model = LitAutoEncoder()
    shard = receive(msg, model)
    model = shard.model
    model.configure_optimizers = shard.rules.attaching(model.configure_optimizers)

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    train_loader, val_loader, _ = load_data(partition_id, num_partitions)

    # Train the model on local data: Lightning runs the loop and the model's own Adam
    trainer = make_trainer(max_epochs=context.run_config["max-epochs"])
    trainer.fit(model, train_loader, val_loader)

    # Construct and return reply Message
    model_record = ArrayRecord(model.state_dict())
    metrics = {
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "num-examples": len(train_loader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"arrays": model_record, "metrics": metric_record})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""

    # Load the model and initialize it with the received weights
    model = LitAutoEncoder()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())

    # Load the data
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, _, test_loader = load_data(partition_id, num_partitions)

    # Evaluate: test() returns one dict of the logged test_* metrics per loader
    (results,) = make_trainer().test(model, test_loader, verbose=False)

    # Construct and return reply Message
    metrics = {
        "eval_loss": results["test_loss"],
        "num-examples": len(test_loader.dataset),
    }
    metric_record = MetricRecord(metrics)
    content = RecordDict({"metrics": metric_record})
    return Message(content=content, reply_to=msg)
