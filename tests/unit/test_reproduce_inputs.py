"""verify-build rebuilds with the build's recorded inputs, the TVM tuning database included."""
import pytest

from edgepack.backends.tvm.tuning import DB_FILES, database_sha256
from edgepack.errors import ArtifactError
from edgepack.reproduce import _tuning_db


def _db(folder, text="[]"):
    folder.mkdir(parents=True, exist_ok=True)
    for f in DB_FILES:
        (folder / f).write_text(text)
    return folder


def _manifest(db_choice, sha):
    return {"build": {"tuning_db": db_choice}, "backend": {"name": "tvm", "tuned": sha is not None,
                                                           "tuning_db_sha256": sha},
            "target": {"name": "x86_64"}}


def test_untuned_builds_rebuild_untuned():
    assert _tuning_db(_manifest("off", None), None) == "off"
    assert _tuning_db(_manifest(None, None), None) is None


def test_the_recorded_database_is_used_while_its_content_is_unchanged(tmp_path):
    db = _db(tmp_path / "db")
    assert _tuning_db(_manifest(str(db), database_sha256(db)), None) == str(db)


def test_a_database_that_grew_since_the_build_is_refused_with_the_fix(tmp_path):
    db = _db(tmp_path / "db")
    m = _manifest(str(db), database_sha256(db))
    (db / DB_FILES[1]).write_text('[["more records"]]')
    with pytest.raises(ArtifactError, match="is not at") as e:
        _tuning_db(m, None)
    assert "--tuning-db PATH" in e.value.hint


def test_a_moved_database_is_accepted_by_content(tmp_path):
    db = _db(tmp_path / "db")
    m = _manifest("/gone/db", database_sha256(db))
    assert _tuning_db(m, tmp_path / "db") == str(db)
