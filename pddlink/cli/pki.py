"""``pddlink pki``: the dev PKI (``pddlink.transport.pki``): a CA kept apart, one directory per node.

pddlink pki init ca/                                  # ca/ca.key (0600), ca/ca.pem: keep ca/ private
pddlink pki issue --ca ca/ --out md-node/ md/md0      # md-node/: md-md0.key, md-md0.pem, ca.pem
pddlink sidecar --role md --tls-dir md-node/ ...
pddlink pki key md-keys/admin-keys                    # a new bearer key (0600): admin_keys_file
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from pddlink.cli.preflight import check_writable


@click.group(name="pki")
def group() -> None:
    """The dev PKI: a CA the operator keeps, one key and certificate per node (never the CA key)."""


@group.command(name="init")
@click.argument("ca_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace an existing CA (every node must be issued again).")
def init(ca_dir: Path, force: bool) -> None:
    """Create a CA in CA_DIR (0700; ca.key 0600, ca.pem 0644)."""
    from pddlink.errors import ConfigError
    from pddlink.transport.pki import CA_KEY, create_ca

    check_writable(ca_dir, "pki init", create=True)
    if (ca_dir / CA_KEY).exists() and not force:
        raise ConfigError(f"{ca_dir} already holds a CA ({CA_KEY}); --force replaces it")
    click.echo(str(create_ca(ca_dir)))


@group.command(name="issue")
@click.option("--ca", "ca_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.argument("identities", nargs=-1, required=True)
def issue(ca_dir: Path, out_dir: Path, identities: tuple[str, ...]) -> None:
    """Issue a key and certificate for each IDENTITY (role/name) into OUT_DIR, with ca.pem only.

    OUT_DIR is what that node (or client: diag/ping for `pddlink ping`) gets as its --tls-dir."""
    from pddlink.transport import PeerIdentity
    from pddlink.transport.pki import issue_node

    parsed = [PeerIdentity.parse(text) for text in identities]
    check_writable(out_dir, "pki issue --out", create=True)
    for identity in parsed:
        tls = issue_node(ca_dir, out_dir, identity)
        files = {"cert": str(tls.cert_file), "key": str(tls.key_file)}
        click.echo(json.dumps({"identity": identity.uri, **files}))


@group.command(name="key")
@click.argument("key_file", type=click.Path(dir_okay=False, path_type=Path))
def key(key_file: Path) -> None:
    """Write a new random bearer key into KEY_FILE (a new file, mode 0600): a sidecar's
    admin_keys_file or the router's api_keys_file. Clients send it as `Authorization: Bearer KEY`."""
    from pddlink.errors import ConfigError
    from pddlink.serving.client_guard import write_key_file

    check_writable(key_file.parent, "pki key", create=True)
    if key_file.exists():
        raise ConfigError(f"{key_file} exists: a key is never overwritten (add a line to it by hand)")
    write_key_file(key_file)
    click.echo(str(key_file))
