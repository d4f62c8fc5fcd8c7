"""Online data mixing: a mixture's weights that follow what the model is learning.

    from tokenfeed.mixing import Bandit, ExcessLoss, OnlineMixer

    mixer = OnlineMixer(loader, Bandit(reward="progress"), every=50, min_weight=0.02)
    for batch in loader:
        ...
        mixer.observe(batch, loss_per_row)   # [B] each row's loss, a tensor or array
        mixer.step()

`OnlineMixer` (mixer.py) sums each source's loss from the training loop, across ranks
with torch.distributed when a process group is initialized, and every `every` steps
asks its policy (policies.py: `ExcessLoss`, DoReMi; `Bandit`, EXP3 as in online data
mixing) for new weights, bounds and rounds them (bounds.py) and sets them on the
loader from the next step on (`FeederClient.set_weights`), so the run's weight
trajectory is in the loader's state dict and a resume at any world size replays it.
docs/mixing.md is the contract. numpy only: torch is used when the losses are tensors
or a process group exists, never imported here.
"""

from tokenfeed.mixing.bounds import bounded, rounded
from tokenfeed.mixing.mixer import OnlineMixer
from tokenfeed.mixing.policies import Bandit, ExcessLoss, Policy

__all__ = ["Bandit", "ExcessLoss", "OnlineMixer", "Policy", "bounded", "rounded"]
