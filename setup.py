"""Install xcit_mm: ``pip install -e .`` (dependencies: see tools/install.sh)."""
from setuptools import find_packages, setup


def read_version():
    scope = {}
    with open('xcit_mm/version.py') as f:
        exec(f.read(), scope)
    return scope['__version__']


setup(
    name='xcit_mm',
    version=read_version(),
    description='XCiT (Cross-Covariance Image Transformer) backbone for '
    'mmdetection and mmsegmentation',
    long_description=open('README.md').read() if __import__('os').path.exists('README.md') else '',
    long_description_content_type='text/markdown',
    packages=find_packages(include=['xcit_mm', 'xcit_mm.*', 'training_extras', 'training_extras.*',
                                    'shapes_world']),
    python_requires='>=3.8',
    # torch/mmcv are installed by tools/install.sh: a bare `torch` requirement would pull the CUDA
    # build and mmcv needs a source build with ops. Only what pip can safely resolve is listed.
    # numpy 1.x, as tools/install.sh pins it: mmcv 2.1 / mmdet 3.3 / mmseg 1.2 were built and
    # tested against it. Checkpoints written under numpy 2 still load (both pickled names are
    # allow-listed, see xcit_mm/models/utils/safe_unpickling.py).
    # safetensors files and hf-hub: names (xcit_mm/models/utils/checkpoint_io.py): the calls and
    # error classes used exist from these releases on; tools/install.sh pins the ones tested.
    install_requires=['mmengine>=0.10,<0.11', 'numpy>=1.23,<2', 'safetensors>=0.4.3',
                      'huggingface_hub>=0.23'],
    # ONNX export and its ONNX Runtime check (tools/deployment/export_onnx.py): releases that
    # install with numpy 1.x (see tools/install.sh).
    # tools/segment_large_image.py (xcit_mm/apis/large_image/), `pip install xcit_mm[geo]`: the
    # backbone needs none of it. rasterio reads every GDAL raster and writes the label and
    # confidence COGs; tifffile reads slide and OME-TIFF tiles (TiffPage.decode), imagecodecs
    # decodes their LZW / JPEG tiles; pyogrio writes the polygons (its Arrow writer: 0.8 and
    # later) and shapely 2 merges them. The wheels bundle GDAL and GEOS. Tested with rasterio
    # 1.4.4, tifffile 2026.3.3, imagecodecs 2026.1.14, pyogrio 0.13.0, shapely 2.2.0.
    extras_require={'onnx': ['onnx==1.17.0', 'onnxruntime==1.20.1'],
                    'geo': ['rasterio>=1.4', 'tifffile>=2023.7.10', 'imagecodecs>=2023.3.16',
                            'pyogrio>=0.8', 'shapely>=2.0']},
    license='Apache-2.0',
    zip_safe=False,
)
