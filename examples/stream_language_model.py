"""A truncated-BPTT language model: each replica carries the hidden state of its own rows.

    python examples/stream_language_model.py               # one replica
    loom run --nproc 2 examples/stream_language_model.py   # two replicas, the same training

``loom.data.stream_batches`` lays the token stream out as parallel rows where row i of each
batch continues row i of the last, and ``distribute`` keeps every row on the same replica, so
the state a replica carries belongs to the tokens it reads next.
"""

import torch
import torch.nn.functional as F
from torch import nn

import loom
from loom.data import stream_batches

VOCAB = 16


def corpus(length: int = 20_000, seed: int = 0) -> torch.Tensor:
    """A Markov chain: each token is one of two successors of the one before, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(VOCAB, (VOCAB, 2), generator=g).tolist()
    choices = torch.randint(2, (length,), generator=g).tolist()
    tokens = [0]
    for choice in choices[1:]:
        tokens.append(successors[tokens[-1]][choice])
    return torch.tensor(tokens)


class LanguageModel(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens, state=None):
        out, state = self.lstm(self.embed(tokens), state)
        return self.head(out), state


def train(strategy: loom.Strategy, batch_size: int = 8, seq_len: int = 16, steps: int | None = None):
    """The trained weights and each step's loss over the global batch."""
    torch.manual_seed(0)
    model, opt = strategy.prepare(LanguageModel(), lambda p: torch.optim.SGD(p, lr=1.0))
    loader = strategy.distribute(stream_batches(corpus(), batch_size, seq_len))
    state, losses = None, []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        logits, state = model(x, state)
        state = tuple(s.detach() for s in state)  # carried to this replica's next batch, its rows' next tokens
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        strategy.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(strategy.reduce(loss.detach())))
    return loom.unwrap(model).state_dict(), losses


def main() -> None:
    strategy = loom.auto_strategy()  # one device alone, Mirrored under `loom run --nproc N`
    _, losses = train(strategy)
    if strategy.is_chief:
        replicas = strategy.num_replicas_in_sync
        print(f"{replicas} replica(s): loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")


if __name__ == "__main__":
    main()
