"""Loss aggregation: catalog B6 numbers, masking, errors."""

import pytest
import torch

from posttrain.algorithms import aggregation

# catalog B6: sequence 1 has token losses [1, 1], sequence 2 has [4] (+ one padded token)
LOSS = torch.tensor([[1.0, 1.0], [4.0, 99.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_names():
    assert aggregation.names() == [
        "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_mean",
    ]


def test_token_mean_b6():
    # (1 + 1 + 4) / 3 tokens = 2.0
    assert aggregation.reduce("token_mean", LOSS, MASK).item() == pytest.approx(2.0)


def test_seq_mean_token_mean_b6():
    # (mean[1, 1] + mean[4]) / 2 = (1 + 4) / 2 = 2.5
    assert aggregation.reduce("seq_mean_token_mean", LOSS, MASK).item() == pytest.approx(2.5)


def test_seq_mean_token_sum_b6():
    # (sum[1, 1] + sum[4]) / 2 = (2 + 4) / 2 = 3.0
    assert aggregation.reduce("seq_mean_token_sum", LOSS, MASK).item() == pytest.approx(3.0)


def test_seq_mean_token_sum_norm_b6():
    # (2 + 4) / L_const with L_const = 4 -> 1.5
    out = aggregation.reduce("seq_mean_token_sum_norm", LOSS, MASK, norm_length=4)
    assert out.item() == pytest.approx(1.5)
    # default L = padded T = 2 -> 6 / 2 = 3.0
    assert aggregation.reduce("seq_mean_token_sum_norm", LOSS, MASK).item() == pytest.approx(3.0)
    with pytest.raises(ValueError):
        aggregation.reduce("seq_mean_token_sum_norm", LOSS, MASK, norm_length=0)


def test_fully_masked_sequence_is_left_out_of_the_sequence_mean():
    loss = torch.tensor([[1.0, 1.0], [4.0, 0.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    # as verl: N' = 2 sequences with a valid token
    assert aggregation.reduce("seq_mean_token_mean", loss, mask).item() == pytest.approx(2.5)
    assert aggregation.reduce("seq_mean_token_sum", loss, mask).item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode", aggregation.names())
def test_masked_tokens_get_no_gradient_and_bool_mask_works(mode):
    loss = LOSS.clone().requires_grad_(True)
    out = aggregation.reduce(mode, loss, MASK.bool())
    out.backward()
    assert loss.grad[1, 1].item() == 0.0 and torch.isfinite(out)


def test_gradient_weights_differ_by_mode():
    # d/dl_it: token_mean 1/3 each; seq_mean_token_mean 1/(2 |y_i|): [1/4, 1/4], [1/2]
    loss = LOSS.clone().requires_grad_(True)
    aggregation.reduce("seq_mean_token_mean", loss, MASK).backward()
    assert loss.grad.tolist() == [[0.25, 0.25], [0.5, 0.0]]


def test_unknown_parameter():
    with pytest.raises(TypeError, match="unknown parameter"):
        aggregation.reduce("token_mean", LOSS, MASK, norm_length=3)
