from tools.testenv import hostpkgs


def test_every_package_says_what_it_is_for() -> None:
    text = hostpkgs.describe(["containerd", "runc"])
    assert "containerd (the container runtime" in text
    assert "runc (the OCI runtime" in text


def test_missing_packages_names_an_absent_package() -> None:
    assert hostpkgs.missing_packages(["weightcache-no-such-package"]) == [
        "weightcache-no-such-package"]
