"""`make setup`'s shortcut (tests/install_check.py): the full pip install runs whenever a requirement of setup.py
as it is now is missing or at a version it does not allow."""
from install_check import declared_requirements, first_unmet


def test_requirements_are_read_from_setup_py_with_the_test_extra():
    reqs = declared_requirements()
    assert "torch==2.13.0" in reqs and "pytest-xdist>=3" in reqs and any(r.startswith("jax>=") for r in reqs)
    assert not any("minilm" in r for r in reqs)  # the encoder extra is installed by its own line of `make setup`
    assert first_unmet(reqs) is None  # this environment ran `make setup`


def test_a_missing_or_outdated_requirement_is_named():
    assert first_unmet(["numpy>=1", "no-such-package-xyz>=1"]) == \
        "no-such-package-xyz is not installed (no-such-package-xyz>=1)"
    assert first_unmet(["numpy<1"]).startswith("numpy ") and "setup.py asks for numpy<1" in first_unmet(["numpy<1"])
    assert first_unmet(["no-such-package-xyz; python_version < '3'"]) is None  # marker false here: not required
    assert first_unmet(["no-such-package-xyz; extra == 'test'"]) is not None
    assert first_unmet(["no-such-package-xyz; extra == 'docs'"]) is None
