"""The public names: all declared, all resolvable, nothing else exported."""

import accelkit as ak


def test_every_public_name_resolves() -> None:
    for name in ak.__all__:
        assert getattr(ak, name) is not None, name
    assert sorted(ak.__all__) == ak.__all__


def test_unknown_names_raise_attribute_error() -> None:
    try:
        ak.Accelerator  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as err:
        assert "Accelerator" in str(err)
    else:
        raise AssertionError("accelkit.Accelerator should not exist")
