"""Slow tier: real `flwr run` against our own SuperLink (simulation), and a loopback deployment
(SuperLink + SuperNodes, each with its own data file, budget and ledger), with and without TLS,
and with CLI-managed SuperNode authentication (only SuperNodes whose keys were registered join).
Success is the run's final status from `flwr list`, never an exit code."""

from __future__ import annotations

import csv
import datetime
import ipaddress
import json
import ssl
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from harness import PUMS

pytestmark = pytest.mark.slow


def only_folder(results: Path) -> Path:
    (folder,) = [p for p in results.iterdir() if p.is_dir()]
    return folder


def clients_csv(folder: Path) -> dict[str, dict[str, str]]:
    with (folder / "clients.csv").open(newline="") as handle:
        return {row["client_id"]: row for row in csv.DictReader(handle)}


def start_simulation_superlink(flower) -> None:
    """A simulation SuperLink (Ray runs the clients) on a free port, with the CLI connection `e2e`."""
    port = flower.free_port()
    flower.start(
        "superlink",
        [
            "flower-superlink",
            "--insecure",
            "--simulation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database",
            ":flwr-in-memory:",
        ],
    )
    flower.wait_healthy(port)
    flower.connect("e2e", port)


@pytest.mark.timeout(300)
def test_flwr_run_simulation_completes_and_refuses_a_relative_results_dir(flower, tmp_path):
    start_simulation_superlink(flower)
    results = tmp_path / "results"
    run_id = flower.submit(
        "e2e", f"results-dir='{results}' num-server-rounds=2", "num-supernodes=3 client-resources-num-cpus=1"
    )
    run = flower.wait_finished(run_id, timeout=200)
    log = flower.run_log(run_id)
    assert run["status"] == "finished:completed", log
    folder = only_folder(results)
    assert f"results folder: {folder}" in log and "round 2/2: accuracy" in log
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["clients"] == 3 and summary["all_within_budget"] is True
    # RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 (OFFLINE_ENV): num-gpus=0 actors still see a GPU if there is one
    assert {row["device"] for row in clients_csv(folder).values()} == {"gpu" if torch.cuda.is_available() else "cpu"}

    bad = flower.submit("e2e", "results-dir='relative/results' num-server-rounds=1", "num-supernodes=2")
    run = flower.wait_finished(bad, timeout=120)
    assert run["status"] == "finished:failed"
    assert "must be an absolute path" in flower.run_log(bad)


@pytest.mark.timeout(300)
def test_flwr_run_simulation_with_both_levels_of_privacy(flower, tmp_path):
    """Client-level DP on the server beside each client's record-level plan, through `flwr run`."""
    start_simulation_superlink(flower)
    results = tmp_path / "results"
    config = (
        f"results-dir='{results}' num-server-rounds=3 federation-epsilon=8.0 federation-cohort=2.0 "
        "federation-rule='calibrated'"
    )
    run_id = flower.submit("e2e", config, "num-supernodes=4 client-resources-num-cpus=1")
    run = flower.wait_finished(run_id, timeout=200)
    log = flower.run_log(run_id)
    assert run["status"] == "finished:completed", log
    assert "client-level DP: 4 members" in log and "federation ε spent" in log
    folder = only_folder(results)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["federation"]["members"] == 4 and summary["federation"]["expected_cohort"] == 2.0
    spent = pd.read_csv(folder / "rounds.csv")["federation_epsilon_spent"].tolist()
    assert len(spent) == 3 and spent == sorted(spent) and spent[0] > 0 and spent[-1] <= 8.0
    assert summary["federation_epsilon_spent"] == spent[-1] and summary["all_within_budget"] is True
    assert (folder / "federation-ledger.sqlite").is_file()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_flwr_run_simulation_shares_a_gpu_between_clients(flower, tmp_path):
    """`client-resources-num-gpus=0.25`: Ray gives every client actor the GPU, four at a time."""
    start_simulation_superlink(flower)
    results = tmp_path / "results"
    run_id = flower.submit(
        "e2e",
        f"results-dir='{results}' num-server-rounds=2 model='cnn'",
        "num-supernodes=6 client-resources-num-cpus=1 client-resources-num-gpus=0.25",
    )
    run = flower.wait_finished(run_id, timeout=240)
    log = flower.run_log(run_id)
    assert run["status"] == "finished:completed", log
    rows = clients_csv(only_folder(results))
    assert len(rows) == 6 and {row["device"] for row in rows.values()} == {"gpu"}, rows


def pums_nodes(tmp_path: Path, budgets: dict[int, float]) -> list[str]:
    """`--node-config` strings: one PUMA file (400 rows), budget and ledger per client."""
    if not PUMS.is_file():
        pytest.skip(f"PUMS file missing: {PUMS}")
    table = pd.read_csv(PUMS)
    configs = []
    for puma, epsilon in budgets.items():
        path = tmp_path / f"puma{puma}.csv"
        table[table.puma == puma].sample(400, random_state=0).to_csv(path, index=False)
        ledger = tmp_path / f"ledger-{puma}.sqlite"
        configs.append(
            f"client-id='puma-{puma}' data-path='{path}' epsilon={epsilon} delta=1e-5 public-size=400 "
            f"ledger-path='{ledger}'"
        )
    return configs


def start_superlink(flower, tls: dict[str, Path] | None = None, *extra: str) -> int:
    """A deployment SuperLink on a free port (TLS when `tls` is given), healthy, with the CLI
    connection `deployment` pointing at it; returns its port."""
    port = flower.free_port()
    link_security = (
        [
            "--ssl-ca-certfile",
            str(tls["ca"]),
            "--ssl-certfile",
            str(tls["cert"]),
            "--ssl-keyfile",
            str(tls["key"]),
        ]
        if tls
        else ["--insecure"]
    )
    flower.start(
        "superlink",
        [
            "flower-superlink",
            *link_security,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--database",
            ":flwr-in-memory:",
            *extra,
        ],
    )
    context = ssl.create_default_context(cafile=str(tls["ca"])) if tls else None
    flower.wait_healthy(port, scheme="https" if tls else "http", context=context)
    flower.connect("deployment", port, root_certificates=tls["ca"] if tls else None)
    return port


def start_supernode(
    flower,
    name: str,
    port: int,
    node_config: str,
    tls: dict[str, Path] | None = None,
    private_key: Path | None = None,
):
    """One SuperNode with its own FLWR_HOME and Runtime API port (and its auth key, if given)."""
    home = flower.home / name
    home.mkdir()
    security = ["--root-certificates", str(tls["ca"])] if tls else ["--insecure"]
    auth = ["--auth-supernode-private-key", str(private_key)] if private_key else []
    return flower.start(
        name,
        [
            "flower-supernode",
            *security,
            *auth,
            "--superlink",
            f"127.0.0.1:{port}",
            "--port",
            str(flower.free_port()),
            "--node-config",
            node_config,
        ],
        home=home,
    )


def start_deployment(flower, node_configs: list[str], tls: dict[str, Path] | None = None) -> int:
    port = start_superlink(flower, tls)
    for i, node_config in enumerate(node_configs):
        start_supernode(flower, f"supernode{i}", port, node_config, tls)
    return port


@pytest.mark.timeout(420)
def test_deployment_runs_and_a_second_run_finds_the_ledger(flower, tmp_path):
    """Run 1 spends about half of each budget (proactive); run 2 (calibrated, which alone would
    spend all of it) starts from the ledgers and stops each client before it would overspend.
    What a node leaves to its own log (a line of its file left out) is in its SuperNode's output."""
    configs = pums_nodes(tmp_path, {1101: 1.0, 1102: 1.0})
    with (tmp_path / "puma1101.csv").open("a") as data:
        data.write("a line that is no record\n")
    start_deployment(flower, configs)
    common = "dataset='pums' min-clients=2"
    first = flower.submit(
        "deployment", f"{common} num-server-rounds=1 rule='proactive' results-dir='{tmp_path / 'r1'}'"
    )
    run = flower.wait_finished(first, timeout=180)
    assert run["status"] == "finished:completed", flower.run_log(first)
    run1 = clients_csv(only_folder(tmp_path / "r1"))
    assert set(run1) == {"puma-1101", "puma-1102"}
    assert all(r["status"] == "ok" and float(r["epsilon_spent"]) <= 1.0 for r in run1.values())
    assert "federated (the server has no data)" in flower.run_log(first)
    assert "1 line(s) left out" in flower.log("supernode0") and "left out" not in flower.log("supernode1")

    second = flower.submit(
        "deployment",
        f"{common} num-server-rounds=2 fraction-evaluate=0 rule='calibrated' results-dir='{tmp_path / 'r2'}'",
    )
    run = flower.wait_finished(second, timeout=180)
    log = flower.run_log(second)
    assert run["status"] == "finished:completed", log
    run2 = clients_csv(only_folder(tmp_path / "r2"))
    for client_id, row in run2.items():
        assert int(row["steps_all_runs"]) >= int(run1[client_id]["steps_all_runs"])  # the ledger carried over
        assert float(row["epsilon_spent"]) <= float(row["epsilon_budget"]) == 1.0
    assert any(row["exhausted_round"] for row in run2.values()), log
    assert "out of budget" in log


def make_certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedprivacy test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


@pytest.mark.timeout(300)
def test_deployment_over_tls(flower, tmp_path):
    certificates = make_certificates(tmp_path)
    start_deployment(flower, pums_nodes(tmp_path, {1103: 1.0, 1104: 2.0}), tls=certificates)
    run_id = flower.submit("deployment", f"dataset='pums' num-server-rounds=1 results-dir='{tmp_path / 'r'}'")
    run = flower.wait_finished(run_id, timeout=180)
    assert run["status"] == "finished:completed", flower.run_log(run_id)
    rows = clients_csv(only_folder(tmp_path / "r"))
    assert {r["client_id"]: float(r["epsilon_budget"]) for r in rows.values()} == {
        "puma-1103": 1.0,
        "puma-1104": 2.0,
    }


def make_supernode_key(path: Path) -> Path:
    """An EC P-384 key pair in the OpenSSH formats flwr loads (what `ssh-keygen -t ecdsa -b 384`
    writes): the private key at `path` for `--auth-supernode-private-key`, the public key at
    `path.pub` for `flwr supernode register`. Returns the public key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
    )
    path.chmod(0o600)
    public = path.with_name(path.name + ".pub")
    openssh = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    public.write_bytes(openssh)
    return public


def node_statuses(flower) -> dict[str, str]:
    """`flwr supernode list`: node id → status (registered, online, offline, unregistered)."""
    return {n["node-id"]: n["status"] for n in flower.cli("supernode", "list", "deployment")["nodes"]}


def wait_online(flower, node_ids: set[str], timeout: float = 90) -> None:
    """Poll `flwr supernode list` until exactly `node_ids` are listed, all online."""
    deadline = time.monotonic() + timeout
    while (statuses := node_statuses(flower)) != dict.fromkeys(node_ids, "online"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not exactly SuperNodes {node_ids} online after {timeout} s: {statuses}")
        time.sleep(2)


@pytest.mark.timeout(300)
def test_supernode_authentication_admits_only_registered_nodes(flower, tmp_path):
    """CLI-managed SuperNode authentication (TLS + `--enable-supernode-auth`): two SuperNodes whose
    public keys were registered with `flwr supernode register` train; one signing with an
    unregistered key and one without a key are refused at connection, never listed, never train."""
    certificates = make_certificates(tmp_path)
    port = start_superlink(flower, certificates, "--enable-supernode-auth")
    *members, intruder, anonymous = pums_nodes(tmp_path, {1105: 1.0, 1106: 1.0, 1107: 1.0, 1101: 1.0})
    keys = [tmp_path / "keys" / f"supernode{i}" for i in range(3)]
    public_keys = [make_supernode_key(key) for key in keys]
    registered = set()
    for public_key in public_keys[:2]:
        reply = flower.cli("supernode", "register", str(public_key), "deployment")
        assert reply.get("success"), reply
        registered.add(str(reply["node-id"]))
    assert node_statuses(flower) == dict.fromkeys(registered, "registered")

    for i, node_config in enumerate(members):
        start_supernode(flower, f"supernode{i}", port, node_config, certificates, private_key=keys[i])
    refused = {
        "intruder": start_supernode(flower, "intruder", port, intruder, certificates, private_key=keys[2]),
        "anonymous": start_supernode(flower, "anonymous", port, anonymous, certificates),
    }
    for name, process in refused.items():
        process.wait(timeout=90)  # refused at connection: the SuperNode exits by itself
        assert process.returncode != 0, flower.log(name)
    assert "Failed to activate SuperNode" in flower.log("intruder")
    assert "All SuperNodes must be registered via the CLI" in flower.log("anonymous")
    wait_online(flower, registered)

    run_id = flower.submit("deployment", f"dataset='pums' num-server-rounds=1 results-dir='{tmp_path / 'r'}'")
    run = flower.wait_finished(run_id, timeout=180)
    assert run["status"] == "finished:completed", flower.run_log(run_id)
    assert set(clients_csv(only_folder(tmp_path / "r"))) == {"puma-1105", "puma-1106"}
    assert node_statuses(flower) == dict.fromkeys(registered, "online")  # the refused never joined
