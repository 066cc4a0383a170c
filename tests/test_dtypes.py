"""The dtype table the daemon sizes tensors with, against torch's own."""

import pytest
import torch

from tierstack.dtypes import ITEMSIZES, dtype_from_name, dtype_name, nbytes_of
from tierstack.errors import InvalidArgumentError


@pytest.mark.parametrize("name", sorted(ITEMSIZES))
def test_every_name_is_torchs_dtype_of_that_size(name):
    dtype = dtype_from_name(name)
    assert dtype is getattr(torch, name) and dtype.itemsize == ITEMSIZES[name]
    assert dtype_name(dtype) == name
    assert nbytes_of(name, (3, 5)) == torch.empty(3, 5, dtype=dtype).nbytes


def test_an_unknown_dtype_is_refused_naming_the_known_ones():
    with pytest.raises(InvalidArgumentError, match="unsupported dtype 'float12'; use one of bfloat16"):
        nbytes_of("float12", (1,))
    with pytest.raises(InvalidArgumentError, match="unsupported dtype torch.complex64"):
        dtype_name(torch.complex64)
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        nbytes_of("float32", (2, -1))
