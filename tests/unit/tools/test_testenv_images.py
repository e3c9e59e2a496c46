from pathlib import Path

from tools.testenv import images


def test_digest_changes_with_recipe_and_file_contents_but_not_caches(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    key = images.digest_inputs(["base"], [tmp_path / "pkg"], tmp_path)
    assert images.digest_inputs(["base"], [tmp_path / "pkg"], tmp_path) == key
    assert images.digest_inputs(["other"], [tmp_path / "pkg"], tmp_path) != key
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "pkg" / "b.pyc").write_bytes(b"\0")
    assert images.digest_inputs(["base"], [tmp_path / "pkg"], tmp_path) == key
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert images.digest_inputs(["base"], [tmp_path / "pkg"], tmp_path) != key


def _allowed(dockerignore: Path) -> set[str]:
    return {line[1:].rstrip("/") for line in dockerignore.read_text().splitlines()
            if line.startswith("!")}


def test_each_image_is_keyed_by_exactly_what_its_build_context_sends() -> None:
    for image in images.DOCKERFILE_IMAGES:
        dockerfile = images.REPO / image.dockerfile
        assert dockerfile.is_file(), image.dockerfile
        ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
        assert _allowed(ignore) == set(image.inputs), image.name
        assert "ARG BASE_IMAGE=" in dockerfile.read_text(), image.name


def test_public_bases_stay_the_dockerfile_defaults() -> None:
    for image in images.DOCKERFILE_IMAGES:
        text = (images.REPO / image.dockerfile).read_text()
        default = next(line.split("=", 1)[1] for line in text.splitlines()
                       if line.startswith("ARG BASE_IMAGE="))
        assert not default.startswith("localhost/"), image.name


def test_the_operator_image_has_no_torch() -> None:
    by_name = {i.name: i for i in images.DOCKERFILE_IMAGES}
    assert by_name["operator"].base == "python"
    assert by_name["sidecar"].base == "torch"
    assert not any("torch" in r for r in images.DEBIAN_PACKAGES)


def test_layer_digests_are_read_from_the_manifests_gc_labels() -> None:
    listing = (
        "DIGEST\tSIZE\tAGE\tLABELS\n"
        "sha256:aa\t244.9MB\t1 minute\tcontainerd.io/uncompressed=sha256:aa\n"
        "sha256:mm\t424B\t1 minute\tcontainerd.io/gc.ref.content.l.0=sha256:aa,"
        "containerd.io/gc.ref.content.l.1=sha256:bb,containerd.io/gc.ref.content.config=sha256:cc\n"
        "sha256:cc\t371B\t1 minute\tcontainerd.io/gc.ref.snapshot.overlayfs=sha256:aa\n"
    )
    assert images.layer_digests(listing) == {"sha256:aa", "sha256:bb"}


def test_stale_images_are_old_generations_and_cri_ids_of_nothing_wanted() -> None:
    listing = (
        "REF TYPE DIGEST SIZE PLATFORMS LABELS\n"
        "localhost/weightcache/sidecar:new app/x sha256:m1 6.1 GiB linux/amd64 -\n"
        "sha256:c1 app/x sha256:m1 6.1 GiB linux/amd64 io.cri=managed\n"
        "localhost/weightcache/sidecar:old app/x sha256:m0 6.1 GiB linux/amd64 -\n"
        "sha256:c0 app/x sha256:m0 6.1 GiB linux/amd64 io.cri=managed\n"
        "docker.io/library/other:1 app/x sha256:m9 1 MiB linux/amd64 -\n"
    )
    assert images.stale_images(listing, {"localhost/weightcache/sidecar:new"}) == [
        "localhost/weightcache/sidecar:old", "sha256:c0"]


def test_a_generation_is_pruned_only_once_no_concurrent_run_can_still_need_it() -> None:
    """Once, a second worktree's build pruned the first's fresh images mid-import."""
    now = 1_800_000_000.0
    listing = "\n".join([
        "localhost/weightcache/sidecar:mine 2027-01-15 08:00:00.5 +0000 UTC",
        "localhost/weightcache/sidecar:theirs-fresh 2027-01-15 07:50:00.123456789 +0000 UTC",
        "localhost/weightcache/sidecar:old 2027-01-15 04:00:00 +0000 UTC",
        "localhost/weightcache/torch:unreadable yesterday",
        "docker.io/library/other:1 2020-01-01 00:00:00 +0000 UTC",
    ])
    stale = images.stale_generations(listing, {"localhost/weightcache/sidecar:mine"}, now)
    assert [ref for ref, _ in stale] == ["localhost/weightcache/sidecar:old",
                                         "localhost/weightcache/torch:unreadable"]
