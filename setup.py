from setuptools import find_packages, setup

setup(
    name="fairseq-rope",
    version="0.1.0",
    description="Rotary Position Embedding (RoFormer) for fairseq machine translation",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fairseq_rope", "fairseq_rope.*"]),
    python_requires=">=3.9",
    # torch and fairseq are installed by scripts/setup_env.sh in a specific order (see README);
    # listing them here would let pip pull a second torch.
    install_requires=[],
    license="MIT",
)
