"""Fake installed distributions for plugin discovery tests."""


def make_distribution(root, dist_name: str, ep_name: str, module_name: str, source: str, version: str = "0.1"):
    """Write an installed-looking distribution (dist-info with an entry point) under ``root``."""
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[runtime]\n{ep_name} = {module_name}\n")
    (root / f"{module_name}.py").write_text(source)
