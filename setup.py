"""Installs stitch-autoload.pth next to the packages (pyproject.toml holds the metadata).

A .pth file must sit at the top of site-packages and setuptools has no declarative way to
put one there: build_py copies it into the build tree (regular wheels), and the editable
wheel gets it in the directory setuptools unpacks into the wheel (``pip install -e``).
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "stitch-autoload.pth"
SOURCE = Path(__file__).parent / PTH


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            (Path(self.build_lib) / PTH).write_text(SOURCE.read_text())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else outputs + [str(Path(self.build_lib) / PTH)]


cmdclass = {"build_py": BuildPyWithPth}
try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        # _install_namespaces writes into the directory that becomes the editable wheel's
        # root (setuptools 64 to 84 at least); our .pth goes in beside its files.
        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            (Path(installation_dir) / PTH).write_text(SOURCE.read_text())

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # setuptools < 64 has no PEP 660 editable wheels
    pass

setup(cmdclass=cmdclass)
