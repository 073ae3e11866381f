"""model_listings.py: the models and checkpoints a server lists, describes, downloads and deletes, as
the unmodified `tinker` SDK's `RestClient` (and a raw HTTP client) reads them."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import tinker

import workbench as wb
from tests.datums import sdk_ce_datum
from tests.server.test_server_bad_input import TOKENS, Unchanged, post
from workbench.server import ServerConfig, TinkerServer


@pytest.fixture
def remote(client: tinker.ServiceClient) -> tinker.TrainingClient:
    model = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    model.forward_backward([sdk_ce_datum(TOKENS)], "cross_entropy").result()  # gradients pending
    return model


def test_models_and_checkpoints_are_listed_described_and_downloaded(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, tmp_path: Path
) -> None:
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    remote.save_state("s1").result()
    sampler_path = remote.save_weights_for_sampler("w1").result().path
    rest = tinker.RestClient(base_url=srv.url)
    assert rest.get_server_capabilities().result().supported_models[0].model_name == "tiny"
    listed_models = rest.list_training_runs().result()
    assert {r.training_run_id for r in listed_models.training_runs} == {sess.model_id, remote.model_id}
    described = rest.get_training_run(remote.model_id).result()
    assert described.model_owner == client.holder.get_session_id() and described.lora_rank == 4
    assert described.last_checkpoint.tinker_path == f"tinker://{remote.model_id}/weights/s1"
    listed = rest.list_checkpoints(remote.model_id).result().checkpoints
    assert sorted(c.checkpoint_id for c in listed) == ["sampler_weights/w1", "weights/s1"]
    assert {c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints} >= {"weights/s1"}
    info = rest.get_weights_info_by_tinker_path(f"tinker://{remote.model_id}/weights/s1").result()
    assert (info.base_model, info.lora_rank, info.train_unembed) == ("tiny", 4, True)
    assert rest.get_weights_info_by_tinker_path(sampler_path).result().lora_rank == 4
    # the archive: a signed link to the checkpoint folder as workbench.export_archive writes it
    link = httpx.get(
        f"{srv.url}/api/v1/training_runs/{remote.model_id}/checkpoints/weights/s1/archive", timeout=30
    )
    assert link.status_code == 302
    download = httpx.get(link.headers["location"], timeout=30)
    assert download.status_code == 200
    (tmp_path / "s1.tar").write_bytes(download.content)
    imported = wb.import_archive(tmp_path / "s1.tar", tmp_path / "imported")
    assert sorted(p.name for p in imported.iterdir()) == sorted(
        p.name for p in sess.engine.checkpoint_folder(f"tinker://{remote.model_id}/weights/s1").iterdir()
    )
    forged = link.headers["location"].replace("signature=", "signature=0")
    assert httpx.get(forged, timeout=30).status_code == 403
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    assert [c.checkpoint_id for c in rest.list_checkpoints(remote.model_id).result().checkpoints] == [
        "weights/s1"
    ]
    with pytest.raises(tinker.NotFoundError, match="no training run"):
        rest.get_training_run("nobody").result()


def test_one_clients_input_cannot_break_the_listings(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, remote: tinker.TrainingClient
) -> None:
    unchanged = Unchanged(sess)
    with pytest.raises(tinker.RequestFailedError, match="ttl_seconds must be"):
        remote.save_state("forever", ttl_seconds=10**30).result()
    tagged = post(srv, "create_session", {"tags": ["\ud800"], "user_metadata": {"\udfff": 1}})
    assert tagged.status_code == 400 and "tags.0" in tagged.json()["error"]
    unchanged.check()
    # a checkpoint whose files went bad on disk is left out of the listings, which still answer
    remote.save_state("good").result()
    bad = remote.save_state("bad").result()  # seq_id 4
    odd = {"model_id": remote.model_id, "seq_id": 5, "path": "odd", "user_metadata": {"k": "\ud800"}}
    refused = post(srv, "save_weights", odd)  # the SDK cannot send it; a raw client can
    assert refused.status_code == 400 and "user_metadata.k: " in refused.json()["error"]
    info_file = sess.engine.checkpoint_folder(bad.path, "state") / "config.json"
    info_file.write_text(json.dumps({**json.loads(info_file.read_text()), "expires_at": 1e300}))
    rest = client.create_rest_client()
    with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
        listed = rest.list_checkpoints(remote.model_id).result().checkpoints
        assert [c.checkpoint_id for c in listed] == ["weights/good"]
        assert [c.checkpoint_id for c in rest.list_user_checkpoints().result().checkpoints] == [
            "weights/good"
        ]
        assert rest.get_training_run(remote.model_id).result().last_checkpoint.checkpoint_id == "weights/good"
        assert httpx.get(f"{srv.url}/api/v1/training_runs").status_code == 200


def test_over_http_a_client_deletes_only_checkpoints_client_sessions_made(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, remote: tinker.TrainingClient
) -> None:
    host = sess.policy.save_state("host").result().path
    unchanged = Unchanged(sess)
    refused = httpx.delete(f"{srv.url}/api/v1/training_runs/{sess.model_id}/checkpoints/weights/host")
    assert refused.status_code == 403 and refused.json()["category"] == "user", refused.text
    assert "made by this server's own session" in refused.json()["error"]
    unchanged.check()
    assert sess.engine.checkpoint_folder(host, "state").is_dir()
    rest = client.create_rest_client()
    own = remote.save_state("own").result().path
    rest.delete_checkpoint_from_tinker_path(own).result()
    with tinker.ServiceClient(base_url=srv.url) as other:  # its session ends: what it made stays deletable
        model = other.create_lora_training_client(base_model="tiny", rank=4).result()
        later = model.save_state("later").result().path
    deleted = httpx.delete(f"{srv.url}/api/v1/training_runs/{model.model_id}/checkpoints/weights/later")
    assert deleted.status_code == 204, deleted.text
    with pytest.raises(wb.CheckpointError):
        sess.engine.folder_of_checkpoint(later)
    with pytest.raises(wb.CheckpointError):
        sess.engine.folder_of_checkpoint(own)


def test_after_a_restart_the_listings_show_the_models_on_disk(sess: wb.Session) -> None:
    first = TinkerServer(sess.engine, ServerConfig())
    try:
        with tinker.ServiceClient(base_url=first.url) as service_client:
            model = service_client.create_lora_training_client(base_model="tiny", rank=4).result()
            saved = model.save_state("before-restart").result().path
    finally:
        first.stop()
    second = TinkerServer(sess.engine, ServerConfig())  # a new server: nothing in memory about the model
    second_client = tinker.ServiceClient(base_url=second.url)
    try:
        rest = second_client.create_rest_client()
        assert saved in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
        assert model.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
        assert rest.get_training_run(model.model_id).result().last_checkpoint.tinker_path == saved
        assert [c.tinker_path for c in rest.list_checkpoints(model.model_id).result().checkpoints] == [saved]
        # found on disk, not made by a client of this server: read-only over HTTP
        refused = httpx.delete(
            f"{second.url}/api/v1/training_runs/{model.model_id}/checkpoints/weights/before-restart"
        )
        assert refused.status_code == 403
    finally:
        second_client.close("success").result()  # its heartbeat would outlive the server
        second.stop()
